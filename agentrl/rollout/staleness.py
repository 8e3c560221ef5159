"""Policy-version lag of trajectories: how far each turn is behind the trainer, the staleness
bound that drops trajectories before training, and metrics by lag (histogram, train-vs-rollout
logprob gap, truncated-importance-sampling clip fraction)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from agentrl.types import Group, Trajectory


def turn_lags(traj: Trajectory, trainer_version: int) -> list[int]:
    """The lag of each turn's oldest token: a turn that straddled an update (a request that went
    on under new weights) is as old as its first tokens, not its last."""
    return [trainer_version - min(t.token_versions(), default=t.weight_version) for t in traj.turns]


def trajectory_lag(traj: Trajectory, trainer_version: int) -> int:
    """The lag of the oldest sampled token: what the staleness bound is checked against."""
    return max(turn_lags(traj, trainer_version), default=0)


def drop_stale(
    groups: Sequence[Group], trainer_version: int, max_staleness: int | None
) -> tuple[list[Group], int]:
    """Trajectories whose oldest turn lags more than `max_staleness` versions are dropped (never
    trained on); a group left empty goes too. Returns (kept groups, trajectories dropped)."""
    if max_staleness is None:
        return [list(g) for g in groups], 0
    kept = []
    num_dropped = 0
    for group in groups:
        fresh = [t for t in group if trajectory_lag(t, trainer_version) <= max_staleness]
        num_dropped += len(group) - len(fresh)
        if fresh:
            kept.append(fresh)
    return kept, num_dropped


def staleness_metrics(groups: Sequence[Group], trainer_version: int) -> dict[str, float]:
    """Lag of every trained turn: max, mean and a histogram (`rollout/staleness_hist/<lag>` =
    fraction of turns at that lag)."""
    lags = [lag for g in groups for t in g for lag in turn_lags(t, trainer_version)]
    if not lags:
        return {}
    out = {
        "rollout/staleness_max": float(max(lags)),
        "rollout/staleness_mean": sum(lags) / len(lags),
    }
    for lag, count in sorted(Counter(lags).items()):
        out[f"rollout/staleness_hist/{lag}"] = count / len(lags)
    return out


def token_lags(traj: Trajectory, trainer_version: int) -> list[int]:
    """One lag per sampled token (aligned with `traj.logprobs`), from the version that sampled
    that token."""
    return [trainer_version - version for turn in traj.turns for version in turn.token_versions()]


def lag_gap_metrics(
    probes: Sequence[tuple[Trajectory, Sequence[float]]], trainer_version: int, tis_cap: float
) -> dict[str, float]:
    """By version lag: mean |trainer logprob - rollout logprob| over sampled tokens, and the
    fraction of tokens whose importance weight exp(trainer - rollout) exceeds `tis_cap` (what
    truncated importance sampling clips). `probes` pairs a trajectory with the trainer's
    logprobs of its sampled tokens, in order."""
    gaps: dict[int, list[float]] = {}
    clipped: dict[int, int] = {}
    for traj, trainer_logprobs in probes:
        lags = token_lags(traj, trainer_version)
        for lag, ours, theirs in zip(lags, trainer_logprobs, traj.logprobs, strict=True):
            gaps.setdefault(lag, []).append(abs(ours - theirs))
            clipped[lag] = clipped.get(lag, 0) + (ours - theirs > math.log(tis_cap))
    out: dict[str, float] = {}
    for lag, values in sorted(gaps.items()):
        out[f"offpolicy/logprob_abs_diff/lag_{lag}"] = sum(values) / len(values)
        out[f"offpolicy/tis_clip_frac/lag_{lag}"] = clipped[lag] / len(values)
    return out


def probe_sample(groups: Sequence[Group], trainer_version: int, per_lag: int) -> list[Trajectory]:
    """Up to `per_lag` trajectories for each oldest-turn lag present (the cheap sample the
    trainer scores for `lag_gap_metrics`, replaying each turn's top-k/top-p filter as training
    does: unreplayed, a gap would be the log of the mass the filter kept, 6.3 nats at top-k 50 on
    a tiny random model, not a mismatch)."""
    picked: dict[int, list[Trajectory]] = {}
    for group in groups:
        for traj in group:
            if not traj.logprobs:
                continue
            bucket = picked.setdefault(trajectory_lag(traj, trainer_version), [])
            if len(bucket) < per_lag:
                bucket.append(traj)
    return [t for _, bucket in sorted(picked.items()) for t in bucket]
