"""Trajectory builders and a fake rollout runner for the eval tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from agentrl.config import RolloutConfig
from agentrl.types import EpisodeStatus, StatusReason, Task, Trajectory, Turn

_REASONS = {
    EpisodeStatus.COMPLETED: StatusReason.DONE,
    EpisodeStatus.TRUNCATED: StatusReason.MAX_TURNS,
    EpisodeStatus.ERROR: StatusReason.ENGINE,
    EpisodeStatus.ABORTED: StatusReason.CANCELLED,
}


def build_traj(
    reward: float = 0.0,
    status: EpisodeStatus = EpisodeStatus.COMPLETED,
    *,
    text: str = "",
    info: dict[str, Any] | None = None,
    num_turns: int = 1,
    num_tool_calls: int = 0,
    num_tool_errors: int = 0,
    task_id: str | None = None,
) -> Trajectory:
    """A valid trajectory: 3 prompt ids, then per turn 2 sampled ids and 1 observation id."""
    token_ids, loss_mask, turns = [1, 2, 3], [0, 0, 0], []
    for i in range(num_turns):
        is_last = i == num_turns - 1
        turns.append(
            Turn(
                start=len(token_ids),
                num_sampled=2,
                num_observation=0 if is_last else 1,
                weight_version=0,
                finish_reason="stop",
                num_tool_calls=num_tool_calls if i == 0 else 0,
                num_tool_errors=num_tool_errors if i == 0 else 0,
                text=text if is_last else "thinking",
            )
        )
        token_ids += [10, 11] + ([] if is_last else [12])
        loss_mask += [1, 1] + ([] if is_last else [0])
    traj = Trajectory(
        token_ids=token_ids,
        loss_mask=loss_mask,
        logprobs=[-0.5] * (2 * num_turns),
        prompt_len=3,
        reward=reward,
        status=status,
        status_reason=_REASONS[status],
        turns=turns,
        task={"id": task_id} if task_id is not None else {},
        info=dict(info or {}),
    )
    traj.check()
    return traj


@pytest.fixture
def make_traj() -> Callable[..., Trajectory]:
    return build_traj


class FakeRunner:
    """Stands in for `RolloutRunner.run_groups` (and the config and token count a progress bar
    reads): records the tasks it is asked to run and returns episodes from
    `episode_for(task, i)`, calling `on_episode` as each one ends."""

    cfg = RolloutConfig()

    def __init__(
        self,
        episode_for: Callable[[Task, int], Trajectory] | None = None,
        fail_on: str | None = None,
    ):
        self.episode_for = episode_for or (lambda task, i: build_traj(reward=float(i % 2)))
        self.fail_on = fail_on
        self.calls: list[dict[str, Any]] = []

    async def run_groups(self, tasks, n, *, temperature=None, seed=None, on_episode=None):
        self.calls.append(
            {"task_ids": [t.id for t in tasks], "n": n, "temperature": temperature, "seed": seed}
        )
        groups = []
        for task in tasks:
            if task.id == self.fail_on:
                raise RuntimeError(f"engine died on {task.id}")
            group = []
            for i in range(n):
                traj = self.episode_for(task, i)
                traj.task = task.to_dict()
                if on_episode is not None:
                    on_episode(traj)
                group.append(traj)
            groups.append(group)
        return groups

    def sampled_tokens(self) -> int:
        return 0

    @property
    def run_task_ids(self) -> list[list[str]]:
        return [c["task_ids"] for c in self.calls]


def make_tasks(num: int) -> list[Task]:
    return [
        Task(id=f"t{i}", data={"question": f"{i}+1", "answer": str(i + 1)}, split="test")
        for i in range(num)
    ]
