"""collect_groups: episodes a dead engine cut end ABORTED/engine, the engines are healed and
those tasks run again; dynamic sampling drops zero-variance groups and refills the batch."""

from __future__ import annotations

from typing import Any

from agentrl.config import RolloutConfig
from agentrl.engine.base import EngineUnavailable
from agentrl.rollout.collect import collect_groups, filter_zero_variance_groups
from agentrl.rollout.group import RolloutRunner
from agentrl.types import EpisodeStatus, StatusReason, Task

from .conftest import ScriptedEngine, ToolEnv


class Tasks:
    def __init__(self, tasks: list[Task]) -> None:
        self.tasks, self.cursor = tasks, 0

    def next_batch(self, n: int) -> list[Task]:
        out = self.tasks[self.cursor : self.cursor + n]
        self.cursor += n
        return out


def _tasks(answers: list[int]) -> Tasks:
    return Tasks([Task(f"t{i}", {"question": "?", "answer": a}) for i, a in enumerate(answers)])


class Heal:
    def __init__(self) -> None:
        self.num_calls = 0

    async def __call__(self) -> int:
        self.num_calls += 1
        return 1 if self.num_calls == 2 else 0  # the heal after the failure restarts one server


async def test_an_engine_death_aborts_episodes_and_their_tasks_run_again(smol_tokenizer: Any):
    dead = EngineUnavailable("connection refused")
    # Call 3 of 4 (one task, n=4) hits the dead server; the re-run of the task succeeds.
    engine = ScriptedEngine(
        smol_tokenizer, ["<answer>5</answer>"] * 2 + [dead] + ["<answer>5</answer>"]
    )
    runner = RolloutRunner(engine, ToolEnv, RolloutConfig(max_turns=2), tokenizer=engine.tokenizer)
    cfg = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=4)
    heal = Heal()

    out = await collect_groups(runner, _tasks([5]), cfg, seed_for_round=lambda r: 0, heal=heal)

    assert out.num_engine_reruns == 1 and out.num_engine_restarts == 1 and heal.num_calls == 2
    (group,) = out.groups
    assert [t.status for t in group] == [EpisodeStatus.COMPLETED] * 4
    assert len(engine.calls) == 8  # 4 episodes, then all 4 again


async def test_the_aborted_episode_is_never_scored(smol_tokenizer: Any):
    engine = ScriptedEngine(smol_tokenizer, [EngineUnavailable("gone")])
    runner = RolloutRunner(engine, ToolEnv, RolloutConfig(max_turns=2), tokenizer=engine.tokenizer)
    (traj,) = await runner.run_group(Task("t", {"answer": 1}), 1)
    assert traj.status == EpisodeStatus.ABORTED and traj.status_reason == StatusReason.ENGINE
    assert not EpisodeStatus(traj.status).is_trainable


async def test_dynamic_sampling_drops_flat_groups_and_refills(smol_tokenizer: Any):
    # Every episode answers 5: tasks whose answer is 5 get all-1 rewards, others all-0. With a
    # flat batch nothing has variance; count what was dropped and that more tasks were drawn.
    engine = ScriptedEngine(smol_tokenizer, ["<answer>5</answer>"])
    runner = RolloutRunner(engine, ToolEnv, RolloutConfig(max_turns=2), tokenizer=engine.tokenizer)
    cfg = RolloutConfig(
        rollout_batch_size=2, n_samples_per_prompt=2, dynamic_sampling=True, max_sampling_rounds=2
    )
    source = _tasks([5, 4, 5, 3, 1, 2])
    out = await collect_groups(runner, source, cfg, seed_for_round=lambda r: r)
    assert out.groups == [] and out.num_zero_variance_dropped == 6
    assert source.cursor == 6  # 2 tasks in the first round, then 2 more in each extra round


class Episode:
    def __init__(self, reward: float, status: EpisodeStatus = EpisodeStatus.COMPLETED):
        self.reward, self.status = reward, status


class RewardsRunner:
    """Stands in for the episodes: a task's group has the rewards its data names."""

    def __init__(self) -> None:
        self.rounds: list[tuple[list[str], int]] = []  # (task ids, seed) per run_groups call

    async def run_groups(
        self, tasks: list[Task], n: int, *, seed: int, on_episode: Any = None
    ) -> list[list[Episode]]:
        self.rounds.append(([t.id for t in tasks], seed))
        groups = [[Episode(r) for r in t.data["rewards"]] for t in tasks]
        for episode in (e for g in groups for e in g):
            if on_episode is not None:
                on_episode(episode)
        return groups


def _reward_tasks(*rewards: list[float]) -> Tasks:
    return Tasks([Task(f"t{i}", {"rewards": r}) for i, r in enumerate(rewards)])


FLAT, VARIED = [1.0, 1.0], [1.0, 0.0]


async def test_dynamic_sampling_refills_with_only_the_missing_tasks():
    source = _reward_tasks(FLAT, VARIED, FLAT, VARIED, FLAT, VARIED, VARIED, VARIED)
    runner = RewardsRunner()
    cfg = RolloutConfig(
        rollout_batch_size=3, n_samples_per_prompt=2, dynamic_sampling=True, max_sampling_rounds=5
    )
    out = await collect_groups(runner, source, cfg, seed_for_round=lambda r: 100 + r)
    # 3 drawn, 1 kept; the 2 missing drawn, 1 kept; the 1 missing drawn and kept: full, stop.
    assert runner.rounds == [(["t0", "t1", "t2"], 100), (["t3", "t4"], 101), (["t5"], 102)]
    assert len(out.groups) == 3 and all(g[0].reward != g[1].reward for g in out.groups)
    assert out.num_zero_variance_dropped == 3 and source.cursor == 6


async def test_dynamic_sampling_gives_a_short_batch_when_its_rounds_run_out():
    source = _reward_tasks(FLAT, VARIED, FLAT, FLAT, VARIED)
    runner = RewardsRunner()
    cfg = RolloutConfig(
        rollout_batch_size=2, n_samples_per_prompt=2, dynamic_sampling=True, max_sampling_rounds=1
    )
    out = await collect_groups(runner, source, cfg, seed_for_round=lambda r: r)
    assert [ids for ids, _ in runner.rounds] == [["t0", "t1"], ["t2"]]  # one extra round only
    assert len(out.groups) == 1 and out.num_zero_variance_dropped == 2


async def test_without_dynamic_sampling_flat_groups_are_kept_and_nothing_is_refilled():
    source = _reward_tasks(FLAT, VARIED, FLAT)
    runner = RewardsRunner()
    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2, max_sampling_rounds=3)
    out = await collect_groups(runner, source, cfg, seed_for_round=lambda r: r)
    assert runner.rounds == [(["t0", "t1"], 0)] and len(out.groups) == 2
    assert out.num_zero_variance_dropped == 0


def test_filter_keeps_groups_with_reward_variance_among_trainable_episodes():
    varied = [Episode(1.0), Episode(0.0)]
    flat = [Episode(1.0), Episode(1.0)]
    # The ERROR member's reward 0 must not make a flat group look varied.
    flat_with_error = [Episode(1.0), Episode(0.0, EpisodeStatus.ERROR)]
    all_error = [Episode(0.0, EpisodeStatus.ERROR)]
    kept, dropped = filter_zero_variance_groups([varied, flat, flat_with_error, all_error])
    assert kept == [varied] and dropped == 3
