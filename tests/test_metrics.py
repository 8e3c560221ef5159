"""rollout_metrics on constructed trajectories; MetricsLogger files."""

from __future__ import annotations

import importlib.util
import json
import math
from contextlib import closing

import pytest

from agentrl.config import ConfigError, LogConfig, RunConfig
from agentrl.config_checks import check_run
from agentrl.run.metrics import MetricsLogger, rollout_metrics
from agentrl.types import EpisodeStatus, StatusReason, Trajectory, Turn

REASONS = {
    EpisodeStatus.COMPLETED: StatusReason.DONE,
    EpisodeStatus.TRUNCATED: StatusReason.MAX_TURNS,
    EpisodeStatus.ERROR: StatusReason.TOOL,
    EpisodeStatus.ABORTED: StatusReason.CANCELLED,
}


def traj(
    reward, status=EpisodeStatus.COMPLETED, *, num_sampled=2, tool_calls=0, tool_errors=0, info=None
):
    """3 prompt ids, one turn of `num_sampled` sampled ids."""
    return Trajectory(
        token_ids=[1, 2, 3] + [9] * num_sampled,
        loss_mask=[0, 0, 0] + [1] * num_sampled,
        logprobs=[-1.0] * num_sampled,
        prompt_len=3,
        reward=reward,
        status=status,
        status_reason=REASONS[status],
        turns=[
            Turn(
                3,
                num_sampled,
                0,
                "0",
                "stop",
                num_tool_calls=tool_calls,
                num_tool_errors=tool_errors,
            )
        ],
        info=info or {},
    )


def test_rollout_metrics_on_constructed_groups() -> None:
    groups = [
        [
            traj(1.0, num_sampled=4, tool_calls=2),
            traj(0.0),
            traj(0.0, EpisodeStatus.ERROR, tool_calls=1, tool_errors=1),
        ],
        [traj(0.5, EpisodeStatus.TRUNCATED, num_sampled=10), traj(0.5, info={"correct": False})],
    ]
    m = rollout_metrics(groups)
    # ERROR's stored 0 is excluded: mean of 1, 0, 0.5, 0.5
    assert m["rollout/reward_mean"] == pytest.approx(0.5)
    assert m["rollout/reward_std"] == pytest.approx(math.sqrt(0.125))
    # 1.0 and the truncated 0.5 pass; info correct=False wins over reward 0.5
    assert m["rollout/pass_rate"] == pytest.approx(2 / 4)
    assert m["rollout/status/error"] == pytest.approx(1 / 5)
    assert m["rollout/status/completed"] == pytest.approx(3 / 5)
    assert m["rollout/status/aborted"] == 0.0
    assert m["rollout/truncated_ratio"] == pytest.approx(1 / 5)
    assert m["rollout/tool_calls_per_episode"] == pytest.approx(3 / 5)
    assert m["rollout/tool_errors_per_episode"] == pytest.approx(1 / 5)
    assert m["rollout/response_len_max"] == 10.0
    assert m["rollout/response_len_mean"] == pytest.approx((4 + 2 + 2 + 10 + 2) / 5)
    assert m["rollout/num_sampled_tokens"] == 20.0
    assert m["rollout/turns_mean"] == 1.0
    assert m["rollout/zero_std_group_fraction"] == pytest.approx(1 / 2)  # group 2: 0.5, 0.5
    assert m["rollout/num_zero_variance_groups"] == 1.0
    assert (
        m["rollout/num_groups"],
        m["rollout/num_episodes"],
        m["rollout/num_scored_episodes"],
    ) == (2, 5, 4)


def test_rollout_metrics_error_only_batch_has_no_reward() -> None:
    m = rollout_metrics([[traj(0.0, EpisodeStatus.ERROR)]])
    assert math.isnan(m["rollout/reward_mean"]) and m["rollout/status/error"] == 1.0


def test_metrics_logger_writes_jsonl_and_tensorboard(tmp_path) -> None:
    with closing(MetricsLogger(tmp_path, config={"train": {"lr": 1e-6}})) as logger:
        assert not (tmp_path / "metrics.jsonl").exists()  # nothing opens before the first log
        logger.log(1, {"rollout/reward_mean": 0.25, "train/kl": float("nan"), "note": "warmup"})
        logger.log(2, {"rollout/reward_mean": 0.75})
        lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    assert (
        lines[0]["rollout/reward_mean"] == 0.25
        and lines[0]["train/kl"] is None
        and lines[0]["note"] == "warmup"
    )
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    event_files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert event_files
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("rollout/reward_mean")] == [(1, 0.25), (2, 0.75)]


def test_metrics_logger_appends_on_resume(tmp_path) -> None:
    for step in (1, 2):
        logger = MetricsLogger(tmp_path, LogConfig(use_tensorboard=False))
        logger.log(step, {"x": step})
        logger.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    assert not (tmp_path / "tensorboard").exists()


def test_a_resumed_logger_drops_the_redone_steps_from_jsonl_and_tensorboard(tmp_path) -> None:
    """Crashed after logging steps 1-3 with a checkpoint at step 1: the resumed run redoes 2 and
    3, and each step is there once, with the redone values (a line cut short goes too)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with closing(MetricsLogger(tmp_path)) as crashed:
        for step in (1, 2, 3):
            crashed.log(step, {"x": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "x"')  # the crash cut this line short
    with closing(MetricsLogger(tmp_path)) as resumed:
        resumed.truncate_after(1)
        assert [json.loads(line)["step"] for line in _lines(tmp_path)] == [1]
        for step in (2, 3):
            resumed.log(step, {"x": 10.0 * step})
        with pytest.raises(RuntimeError, match="before the first log"):
            resumed.truncate_after(1)
    assert [(r["step"], r["x"]) for r in map(json.loads, _lines(tmp_path))] == [
        (1, 1.0),
        (2, 20.0),
        (3, 30.0),
    ]
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("x")] == [(1, 1.0), (2, 20.0), (3, 30.0)]


def test_truncating_a_run_without_metrics_writes_nothing(tmp_path) -> None:
    logger = MetricsLogger(tmp_path, LogConfig(use_tensorboard=False))
    logger.truncate_after(5)
    assert not (tmp_path / "metrics.jsonl").exists()


def _lines(run_dir) -> list[str]:
    return (run_dir / "metrics.jsonl").read_text().splitlines()


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_asked_but_missing_is_a_config_error_before_the_run() -> None:
    cfg = RunConfig(log=LogConfig(use_wandb=True))
    with pytest.raises(ConfigError, match="log.use_wandb=true but wandb is not installed; pip"):
        check_run(cfg)


def test_rollout_metrics_count_serving_engines_and_split_episodes() -> None:
    def served(*urls: str) -> Trajectory:
        t = traj(1.0)
        t.turns = [Turn(3, 1, 0, "0", "stop", served_by=u) for u in urls]
        return t

    m = rollout_metrics([[served("http://a", "http://a"), served("http://b")]])
    assert (m["rollout/num_serving_engines"], m["rollout/num_split_episodes"]) == (2.0, 0.0)
    m = rollout_metrics([[served("http://a", "http://b"), served("http://a")]])
    assert (m["rollout/num_serving_engines"], m["rollout/num_split_episodes"]) == (2.0, 1.0)
    # An in-process engine names no server: no routing metrics at all.
    assert "rollout/num_serving_engines" not in rollout_metrics([[traj(1.0)]])
