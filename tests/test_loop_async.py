"""Asynchronous training end to end on the `slow_tools` env (long-tailed tool latency) with a
tiny random model on CPU: both async modes complete their steps, no trained trajectory is past
the staleness bound, every turn records its policy version, and episodes that span a weight
update finish and are trained on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.config import ConfigError, recipe_for_env
from agentrl.rollout.staleness import trajectory_lag
from agentrl.run import train
from agentrl.types import EpisodeStatus, read_jsonl


def _config(model_path: str, save: Path, mode: str | None):
    cfg = recipe_for_env("slow_tools")
    cfg.model.path, cfg.checkpoint.save = model_path, str(save)
    cfg.env.kwargs = {"num_turns": 3, "median_latency_s": 0.05, "latency_sigma": 1.0}
    cfg.train.num_rollout, cfg.train.lr = 5, 1e-2
    cfg.algo.entropy_coef = 1e-3  # every step trains, even a batch whose groups tie on reward
    cfg.rollout.rollout_batch_size, cfg.rollout.n_samples_per_prompt = 2, 2
    cfg.rollout.rollout_max_response_len, cfg.rollout.max_turns = 8, 3
    cfg.eval.num_eval_tasks, cfg.eval.eval_at_start = 2, False
    cfg.checkpoint.save_interval = 100
    cfg.log.progress, cfg.log.use_tensorboard = False, False
    if mode is not None:
        cfg.train.use_async, cfg.train.async_mode = True, mode
    return cfg


def _trained(run_dir: Path) -> dict[int, list]:
    """Trajectories trained at each trainer version (the step file's number minus one)."""
    files = sorted((run_dir / "rollouts").glob("step_*.jsonl"))
    return {int(f.stem.split("_")[1]) - 1: read_jsonl(str(f)) for f in files}


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/loss" in r]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one_step", "full"])
def test_async_modes_train_within_the_staleness_bound(tiny_model_path, tmp_path, mode):
    cfg = _config(tiny_model_path, tmp_path / mode, mode)
    cfg.train.max_staleness = 1 if mode == "one_step" else 2
    result = train(cfg)
    assert result.num_steps == 5
    trained = _trained(tmp_path / mode)
    assert sorted(trained) == [0, 1, 2, 3, 4]
    for version, trajs in trained.items():
        assert trajs
        for t in trajs:
            assert t.turns and all(turn.weight_version.isdigit() for turn in t.turns)
            assert trajectory_lag(t, version) <= cfg.train.max_staleness
    rows = _metrics(tmp_path / mode)
    assert len(rows) == 5
    for row in rows:  # the pace metrics of every step
        for key in ("perf/trainer_idle_frac", "perf/engine_idle_frac", "rollout/queue_depth",
                    "rollout/episodes_in_flight", "rollout/num_stale_dropped",
                    "train/tis_weight_mean"):  # fmt: skip
            assert key in row, (key, row)
        assert any(k.startswith("rollout/staleness_hist/") for k in row)
    assert any("offpolicy/logprob_abs_diff/lag_1" in r for r in rows)  # TIS on by default
    assert json.loads((tmp_path / mode / "run_config.json").read_text())["algo"]["use_tis"]


@pytest.mark.slow
def test_full_async_episodes_span_weight_updates_and_are_trained(tiny_model_path, tmp_path):
    cfg = _config(tiny_model_path, tmp_path / "run", "full")
    cfg.env.kwargs["median_latency_s"] = 0.2  # tool calls outlast a train step
    cfg.train.max_staleness = 4
    cfg.train.num_episodes_in_flight = 8
    train(cfg)
    spanning = [
        t
        for trajs in _trained(tmp_path / "run").values()
        for t in trajs
        if len({turn.weight_version for turn in t.turns}) > 1
    ]
    assert spanning, "no trained episode spanned a weight update"
    assert all(t.status == EpisodeStatus.COMPLETED for t in spanning)  # none aborted
    for t in spanning:  # each turn kept the version it was sampled with, in order
        versions = [int(turn.weight_version) for turn in t.turns]
        assert versions == sorted(versions)


def test_async_settings_that_cannot_work_are_refused_by_name(tmp_path):
    cfg = _config("unused", tmp_path, "full")
    cfg.cluster.colocate = True
    with pytest.raises(ConfigError, match="--colocate"):
        train(cfg)
    cfg = _config("unused", tmp_path, None)
    cfg.train.async_mode = "full"
    with pytest.raises(ConfigError, match="use_async"):
        train(cfg)
    cfg = _config("unused", tmp_path, "one_step")
    cfg.train.update_weights_interval, cfg.train.max_staleness = 3, 2
    with pytest.raises(ConfigError, match="--max-staleness=2"):
        train(cfg)
