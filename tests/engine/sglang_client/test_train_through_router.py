"""`agentrl train` on CPU (local Ray, gloo) with two `agentrl serve` engines behind the real
router binary that agentrl picks (`smg` with consistent_hashing): the run completes, each
engine serves the trainer's weights after every sync, and nothing outlives it. Runs where the
router is importable (scripts/ci_sglang.sh sets AGENTRL_SMG_PATH)."""

from __future__ import annotations

import json
import os

import pytest

from tests.support.configs import tiny_train_config

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
    cfg = tiny_train_config(
        tiny_model_path, tmp_path / "run", actor_num_gpus_per_node=1, rollout_num_gpus=2
    )
    cfg.cluster.use_sglang_router = True

    result = train(cfg)

    assert result.num_steps == 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "train/loss" in r}
    assert sorted(steps) == [1, 2]
    for step, row in steps.items():
        assert row["weight_sync/max_logprob_abs_diff"] < 1e-4, (step, row)
