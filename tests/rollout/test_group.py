"""RolloutRunner: n episodes per task, a global concurrency limit, deterministic seeds, and
one failing episode never failing the batch."""

from __future__ import annotations

from typing import Any

import pytest

from agentrl.config import RolloutConfig, RunConfig
from agentrl.rollout.codec import ChatCodec, CodecCheckError
from agentrl.rollout.group import RolloutRunner, build_runner, episode_seed
from agentrl.types import EpisodeStatus, StatusReason, Task

from .conftest import ScriptedEngine, ToolEnv, call, load_tokenizer

TASKS = [Task(id=f"t{i}", data={"question": f"{i} + 3?", "answer": i + 3}) for i in range(5)]


def runner_with(
    engine: ScriptedEngine, *, envs: list[ToolEnv] | None = None, **cfg: Any
) -> RolloutRunner:
    def factory() -> ToolEnv:
        env = ToolEnv()
        if envs is not None:
            envs.append(env)
        return env

    rollout = RolloutConfig(max_turns=3, rollout_max_response_len=200, **cfg)
    return RolloutRunner(engine, factory, rollout, tokenizer=engine.tokenizer)


async def test_run_group_gives_n_episodes_with_their_own_envs_and_seeds(
    smol_tokenizer: Any,
) -> None:
    envs: list[ToolEnv] = []
    engine = ScriptedEngine(smol_tokenizer, ["<answer>5</answer>"])
    runner = runner_with(engine, envs=envs, seed=3)
    group = await runner.run_group(Task("t0", {"answer": 5}), 4)

    assert [t.status for t in group] == [EpisodeStatus.COMPLETED] * 4
    assert len({t.group_id for t in group}) == 1 and len({t.episode_id for t in group}) == 4
    # one probe env for the codec check, then one fresh env per episode
    assert len(envs) == 5 and all(e.events[-1] == "close" for e in envs)
    seeds = sorted(s.seed for _, s in engine.calls)
    assert seeds == sorted(episode_seed(3, "t0", i) for i in range(4))
    assert len(set(seeds)) == 4
    # the progress display's work: every sampled token, whatever the engine counts
    assert runner.sampled_tokens() == sum(len(c.ids) for c in engine.completions) > 0


def test_episode_seed_is_deterministic_and_distinct() -> None:
    assert episode_seed(0, "t0", 0) == episode_seed(0, "t0", 0)
    assert len({episode_seed(s, t, i) for s in (0, 1) for t in ("a", "b") for i in range(3)}) == 12
    assert 0 <= episode_seed(123, "x", 7) < 2**31


async def test_run_groups_respects_the_global_concurrency_limit(smol_tokenizer: Any) -> None:
    engine = ScriptedEngine(smol_tokenizer, ["<answer>5</answer>"], delay_s=0.01)
    seen: list[str] = []
    runner = runner_with(engine, max_concurrent_episodes=3)
    groups = await runner.run_groups(TASKS, 4, on_episode=lambda t: seen.append(t.episode_id))

    assert [g[0].task["id"] for g in groups] == [t.id for t in TASKS]
    assert [len(g) for g in groups] == [4] * 5
    assert engine.max_in_flight == 3
    assert sorted(seen) == sorted(t.episode_id for g in groups for t in g)


async def test_a_failing_episode_never_fails_the_batch(smol_tokenizer: Any) -> None:
    num_made = 0

    def factory() -> ToolEnv:
        nonlocal num_made
        num_made += 1
        if num_made == 3:
            raise OSError("no sandbox left")
        return ToolEnv(fail_on="step" if num_made == 4 else None)

    engine = ScriptedEngine(smol_tokenizer, ["<answer>5</answer>"])
    runner = RolloutRunner(
        engine, factory, RolloutConfig(max_concurrent_episodes=1), tokenizer=engine.tokenizer
    )
    group = await runner.run_group(Task("t0", {"answer": 5}), 4, on_episode=lambda t: 1 / 0)

    statuses = [(t.status, t.status_reason) for t in group]
    assert statuses.count((EpisodeStatus.COMPLETED, StatusReason.DONE)) == 2
    assert statuses.count((EpisodeStatus.ERROR, StatusReason.ENV)) == 2
    assert any("no sandbox left" in t.info.get("error", "") for t in group)


async def test_episode_timeout_comes_from_the_config(smol_tokenizer: Any) -> None:
    engine = ScriptedEngine(smol_tokenizer, [call("add", '{"a": 1, "b": 1}')], delay_s=0.05)
    group = await runner_with(engine, episode_timeout_s=0.02).run_group(TASKS[0], 2)
    assert {(t.status, t.status_reason) for t in group} == {
        (EpisodeStatus.TRUNCATED, StatusReason.WALL_CLOCK)
    }


async def test_temperature_override_and_config_sampling(smol_tokenizer: Any) -> None:
    engine = ScriptedEngine(smol_tokenizer, ["<answer>5</answer>"])
    runner = runner_with(engine, rollout_temperature=0.7, rollout_top_p=0.9)
    await runner.run_group(TASKS[0], 1)
    await runner.run_group(TASKS[0], 1, temperature=0.0)
    (_, first), (_, second) = engine.calls
    assert (first.temperature, first.top_p, first.max_new_tokens) == (0.7, 0.9, 200)
    assert second.temperature == 0.0


async def test_runner_checks_the_codec_before_any_episode(
    smol_tokenizer: Any, smollm2_path: str
) -> None:
    engine = ScriptedEngine(smol_tokenizer, ["<answer>5</answer>"])
    codec = ChatCodec(load_tokenizer(smollm2_path, "drops_think"))
    runner = RolloutRunner(engine, ToolEnv, RolloutConfig(), codec=codec)
    with pytest.raises(CodecCheckError, match="not prefix-preserving"):
        await runner.run_group(TASKS[0], 2)
    assert engine.calls == []


async def test_build_runner_makes_envs_from_the_registry(smol_tokenizer: Any) -> None:
    cfg = RunConfig()
    cfg.env.id = "calculator"
    cfg.rollout.max_turns = 2
    engine = ScriptedEngine(
        smol_tokenizer, [call("calculate", '{"expression": "2 + 3"}'), "<answer>5</answer>"]
    )
    runner = build_runner(cfg, engine)  # type: ignore[arg-type]
    assert runner.codec is not None and runner.codec.tool_call_format == "hermes"
    (traj,) = await runner.run_group(Task("c0", {"question": "What is 2 + 3?", "answer": 5}), 1)
    assert (traj.status, traj.reward, traj.num_turns) == (EpisodeStatus.COMPLETED, 1.0, 2)
    assert traj.turns[0].num_tool_calls == 1 and traj.turns[0].num_tool_errors == 0


async def test_an_env_factory_that_raises_gives_an_error_trajectory(smol_tokenizer: Any) -> None:
    made: list[ToolEnv] = []

    def factory() -> ToolEnv:
        if made:  # the codec check's probe env works; the episodes' do not
            raise RuntimeError("no sandbox left")
        made.append(ToolEnv())
        return made[0]

    engine = ScriptedEngine(smol_tokenizer, ["<answer>5</answer>"])
    runner = RolloutRunner(engine, factory, RolloutConfig(max_turns=3), tokenizer=engine.tokenizer)
    group = await runner.run_group(Task("t0", {"answer": 5}), 2)
    assert [(t.status, t.status_reason) for t in group] == [
        (EpisodeStatus.ERROR, StatusReason.ENV)
    ] * 2
    assert all(t.info["error_where"] == "env_factory" for t in group)
    assert all("no sandbox left" in t.info["error"] for t in group)
    assert [t.episode_id for t in group] == [f"{group[0].group_id}/{i}" for i in range(2)]
    assert group[0].token_ids == [] and not engine.calls


async def two_conversations(task: Any, client: Any) -> float:
    """Two calls, the second not extending the first: two segments (trajectories) per episode."""
    for text in ("first", "second, afresh"):
        await client.chat.completions.create(
            model="p", messages=[{"role": "user", "content": text}]
        )
    return 1.0


def test_a_runner_without_codec_or_tokenizer_is_refused_at_once(smol_tokenizer: Any) -> None:
    engine = ScriptedEngine(smol_tokenizer, ["ok"])
    with pytest.raises(ValueError, match="needs codec= .* or tokenizer="):
        RolloutRunner(engine, ToolEnv, RolloutConfig())


async def test_an_agents_episode_of_several_segments_is_told_once(smol_tokenizer: Any) -> None:
    """Progress lines count episodes: 2 episodes of 2 segments each are 2, not 4."""
    runner = RolloutRunner(
        ScriptedEngine(smol_tokenizer, ["ok"]),
        ToolEnv,
        RolloutConfig(max_turns=3, rollout_max_response_len=16),
        tokenizer=smol_tokenizer,
        agent=two_conversations,
    )
    told: list[Any] = []
    try:
        group = await runner.run_group(TASKS[0], 2, on_episode=told.append)
    finally:
        await runner.close()
    assert len(group) == 4 and {t.info["num_segments"] for t in group} == {2}
    assert len(told) == 2 and {t.episode_id for t in told} == {t.episode_id for t in group}
    assert all(t.info["segment"] == 1 for t in told)  # each episode's last conversation
    assert runner.sampled_tokens() == sum(t.num_sampled for t in group) > 0  # every segment's
