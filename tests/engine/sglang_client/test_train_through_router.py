"""`agentrl train` on CPU (local Ray, gloo) with two `agentrl serve` engines behind the real
router binary that agentrl picks (`smg` with consistent_hashing): the run completes, each
engine serves the trainer's weights after every sync, and nothing outlives it. Runs where the
router is importable (scripts/ci_sglang.sh sets AGENTRL_SMG_PATH)."""

from __future__ import annotations

import json
import os

import pytest

from agentrl.config import recipe_for_env

pytestmark = pytest.mark.slow

SMG_PATH = os.environ.get("AGENTRL_SMG_PATH")


def test_train_two_steps_with_two_engines_behind_the_router(tiny_model_path, tmp_path, monkeypatch):
    if not SMG_PATH:
        pytest.skip("no router binary: set AGENTRL_SMG_PATH (scripts/ci_sglang.sh does)")
    from agentrl.run import train

    # The driver finds smg (choose_router) and the router subprocess imports it.
    monkeypatch.syspath_prepend(SMG_PATH)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(p for p in (SMG_PATH, os.environ.get("PYTHONPATH")) if p)
    )
    monkeypatch.setenv("AGENTRL_API_KEY", "router-key")  # the router passes it to the workers
    cfg = recipe_for_env("calculator")
    cfg.model.path = tiny_model_path
    cfg.checkpoint.save = str(tmp_path / "run")
    cfg.train.num_rollout = 2
    cfg.train.lr = 1e-3
    cfg.algo.entropy_coef = 1e-3  # the random model earns no reward: entropy still moves weights
    cfg.rollout.rollout_batch_size = 2
    cfg.rollout.n_samples_per_prompt = 2
    cfg.rollout.rollout_max_response_len = 12
    cfg.rollout.max_turns = 2
    cfg.eval.num_eval_tasks = 2
    cfg.eval.eval_at_start = False
    cfg.log.progress = False
    cfg.log.use_tensorboard = False
    cfg.cluster.actor_num_gpus_per_node = 1
    cfg.cluster.rollout_num_gpus = 2
    cfg.cluster.use_sglang_router = True

    result = train(cfg)

    assert result.num_steps == 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "train/loss" in r}
    assert sorted(steps) == [1, 2]
    for step, row in steps.items():
        assert row["weight_sync/max_logprob_abs_diff"] < 1e-4, (step, row)
