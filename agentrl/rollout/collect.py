"""One train step's groups: run the tasks, re-run those whose episodes a dead engine aborted
(after the engines are healed), and with dynamic sampling drop zero-variance groups and sample
more tasks to refill the batch."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentrl.config import RolloutConfig
from agentrl.rollout.group import RolloutRunner
from agentrl.types import EpisodeStatus, Group, StatusReason, Task, Trajectory


def filter_zero_variance_groups(groups: Sequence[Group]) -> tuple[list[Group], int]:
    """Drop groups whose trainable rewards all match (no learning signal): (kept, num_dropped)."""
    kept = []
    for group in groups:
        rewards = [float(t.reward) for t in group if EpisodeStatus(t.status).is_trainable]
        if rewards and max(rewards) > min(rewards):
            kept.append(group)
    return kept, len(groups) - len(kept)


def is_engine_aborted(group: Group) -> bool:
    """Some episode of the group was cut by an engine that died: the group is incomplete."""
    return any(
        EpisodeStatus(t.status) == EpisodeStatus.ABORTED
        and StatusReason(t.status_reason) == StatusReason.ENGINE
        for t in group
    )


@dataclass
class Collected:
    groups: list[Group]
    num_zero_variance_dropped: int = 0
    num_engine_reruns: int = 0  # groups run again because an engine died under them
    num_engine_restarts: int = 0
    num_stale_dropped: int = 0  # trajectories past the staleness bound, never trained on
    dropped: list[Group] = field(default_factory=list)  # by dynamic sampling: tied, or all failed


class TaskSupply(Protocol):
    def next_batch(self, n: int) -> list[Task]: ...


async def _no_heal() -> int:
    return 0


async def collect_groups(
    runner: RolloutRunner,
    source: TaskSupply,
    cfg: RolloutConfig,
    *,
    seed_for_round: Callable[[int], int],
    max_rerun_rounds: int = 2,
    heal: Callable[[], Awaitable[int]] = _no_heal,
    on_episode: Callable[[Trajectory], Any] | None = None,
) -> Collected:
    """`cfg.rollout_batch_size` groups of `cfg.n_samples_per_prompt` episodes. `heal()` restarts
    dead engines and syncs them; it runs before each round and before each re-run.
    `on_episode(trajectory)` is called as each episode ends (the progress display)."""
    want = cfg.rollout_batch_size
    out = Collected(groups=[])
    extra_rounds = cfg.max_sampling_rounds if cfg.dynamic_sampling else 0
    for round_index in range(1 + extra_rounds):
        tasks = source.next_batch(want - len(out.groups))
        groups = await _run_with_reruns(
            runner,
            tasks,
            cfg.n_samples_per_prompt,
            seed_for_round(round_index),
            max_rerun_rounds,
            heal,
            out,
            on_episode,
        )
        if cfg.dynamic_sampling:
            kept, dropped = filter_zero_variance_groups(groups)
            out.num_zero_variance_dropped += dropped
            out.dropped += [g for g in groups if not any(g is k for k in kept)]
            groups = kept
        out.groups.extend(groups)
        if len(out.groups) >= want:
            break
    out.groups = out.groups[:want]
    return out


async def _run_with_reruns(
    runner: RolloutRunner,
    tasks: list[Task],
    n: int,
    seed: int,
    max_rerun_rounds: int,
    heal: Callable[[], Awaitable[int]],
    out: Collected,
    on_episode: Callable[[Trajectory], Any] | None = None,
) -> list[Group]:
    out.num_engine_restarts += await heal()
    groups = await runner.run_groups(tasks, n, seed=seed, on_episode=on_episode)
    for _ in range(max_rerun_rounds):
        broken = [i for i, g in enumerate(groups) if is_engine_aborted(g)]
        if not broken:
            break
        out.num_engine_reruns += len(broken)
        out.num_engine_restarts += await heal()
        # Same seed: the re-run plays the episodes the dead engine would have served.
        redone = await runner.run_groups(
            [tasks[i] for i in broken], n, seed=seed, on_episode=on_episode
        )
        for i, group in zip(broken, redone, strict=True):
            groups[i] = group
    return groups
