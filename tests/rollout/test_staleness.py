"""Staleness: lags per turn, the bound that drops trajectories before training, the histogram
and the by-lag off-policy metrics."""

from __future__ import annotations

import math

import pytest

from agentrl.rollout.staleness import (
    drop_stale,
    lag_gap_metrics,
    probe_sample,
    staleness_metrics,
    token_lags,
    trajectory_lag,
)
from agentrl.types import EpisodeStatus, StatusReason, Trajectory, Turn


def _traj(versions: list[int], logprobs_per_turn: int = 2) -> Trajectory:
    turns = [
        Turn(start=1 + i * logprobs_per_turn, num_sampled=logprobs_per_turn, num_observation=0,
             weight_version=v, finish_reason="stop")
        for i, v in enumerate(versions)
    ]  # fmt: skip
    n = logprobs_per_turn * len(versions)
    return Trajectory(
        token_ids=[0] * (1 + n), loss_mask=[0] + [1] * n, logprobs=[-1.0] * n, prompt_len=1,
        reward=1.0, status=EpisodeStatus.COMPLETED, status_reason=StatusReason.DONE, turns=turns,
    )  # fmt: skip


def test_the_oldest_turn_decides_a_trajectorys_lag():
    assert trajectory_lag(_traj([3, 5]), trainer_version=5) == 2


def test_drop_stale_drops_trajectories_past_the_bound_and_empty_groups():
    fresh, old, older = _traj([4, 5]), _traj([3]), _traj([1, 5])
    kept, num_dropped = drop_stale([[fresh, old], [older]], trainer_version=5, max_staleness=2)
    assert kept == [[fresh, old]] and num_dropped == 1
    assert drop_stale([[older]], 5, None) == ([[older]], 0)


def test_staleness_histogram_is_the_fraction_of_turns_at_each_lag():
    metrics = staleness_metrics([[_traj([4, 5]), _traj([5, 5])]], trainer_version=5)
    assert metrics["rollout/staleness_hist/0"] == pytest.approx(0.75)
    assert metrics["rollout/staleness_hist/1"] == pytest.approx(0.25)
    assert metrics["rollout/staleness_max"] == 1.0


def test_gap_and_clip_fraction_are_split_by_the_lag_of_each_turn():
    traj = _traj([4, 5])  # rollout logprobs all -1.0
    trainer = [-1.0 + math.log(3.0), -1.0, -0.9, -1.1]  # lag-1 turn: one weight 3 > cap 2
    metrics = lag_gap_metrics([(traj, trainer)], trainer_version=5, tis_cap=2.0)
    assert metrics["offpolicy/tis_clip_frac/lag_1"] == 0.5
    assert metrics["offpolicy/logprob_abs_diff/lag_1"] == pytest.approx(math.log(3.0) / 2)
    assert metrics["offpolicy/tis_clip_frac/lag_0"] == 0.0
    assert metrics["offpolicy/logprob_abs_diff/lag_0"] == pytest.approx(0.1)


def test_probe_sample_takes_a_few_trajectories_of_every_lag():
    groups = [[_traj([5]) for _ in range(4)], [_traj([3]), _traj([4])]]
    picked = probe_sample(groups, trainer_version=5, per_lag=2)
    assert sorted(trajectory_lag(t, 5) for t in picked) == [0, 0, 1, 2]
    truncated = _traj([2])
    truncated.turns[0].is_logprob_truncated = True  # the trainer replays its filter: probed too
    picked = probe_sample([*groups, [truncated]], trainer_version=5, per_lag=2)
    assert sorted(trajectory_lag(t, 5) for t in picked) == [0, 0, 1, 2, 3]


def test_a_turn_that_straddled_an_update_is_as_old_as_its_first_token():
    """slime #2092: a sample trained unmasked on tokens of three weight versions. A retracted
    request that went on under new weights records each span; its oldest token decides."""
    straddling = _traj([5], logprobs_per_turn=5)
    straddling.turns[0].version_spans = [(2, 2), (4, 1), (5, 2)]
    straddling.check()
    assert token_lags(straddling, trainer_version=5) == [3, 3, 1, 0, 0]
    assert trajectory_lag(straddling, trainer_version=5) == 3
    kept, num_dropped = drop_stale([[straddling, _traj([5])]], trainer_version=5, max_staleness=2)
    assert num_dropped == 1 and kept == [[_traj([5])]]
    assert staleness_metrics([[straddling]], trainer_version=5)["rollout/staleness_max"] == 3.0


def test_version_spans_must_cover_the_turn():
    traj = _traj([5], logprobs_per_turn=3)
    traj.turns[0].version_spans = [(4, 1), (5, 1)]
    with pytest.raises(ValueError, match="version_spans cover 2 tokens of 3"):
        traj.check()
