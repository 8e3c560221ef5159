"""run_episode: token-exact trajectories (ids and logprobs verbatim, mask 1 exactly on sampled
ids), tool failures as observations, and every way an episode ends."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentrl.engine.base import Completion, EngineError, FinishReason, SamplingParams
from agentrl.envs import StepResult
from agentrl.rollout.codec import ChatCodec
from agentrl.rollout.episode import run_episode
from agentrl.rollout.staleness import drop_stale
from agentrl.types import EpisodeStatus, Message, StatusReason, Trajectory

from .conftest import TASK, ScriptedEngine, ToolEnv, call


@pytest.fixture(scope="module")
def codec(smol_tokenizer: Any) -> ChatCodec:
    return ChatCodec(smol_tokenizer)


async def play(
    codec: ChatCodec,
    replies: list[Any],
    *,
    env: ToolEnv | None = None,
    engine: ScriptedEngine | None = None,
    sampling: SamplingParams | None = None,
    max_turns: int = 6,
    max_context_len: int = 4096,
    max_observation_tokens: int | None = None,
    timeout_s: float | None = None,
) -> tuple[Trajectory, ScriptedEngine, ToolEnv]:
    env = env or ToolEnv()
    engine = engine or ScriptedEngine(codec.tokenizer, replies)
    traj = await run_episode(
        env,
        engine,
        codec,
        TASK,
        sampling or SamplingParams(max_new_tokens=200, seed=11),
        max_turns=max_turns,
        max_context_len=max_context_len,
        max_observation_tokens=max_observation_tokens,
        timeout_s=timeout_s,
        group_id="g",
        episode_id="g/0",
    )
    traj.check()
    return traj, engine, env


def sampled_spans(traj: Trajectory) -> list[list[int]]:
    return [traj.token_ids[t.start : t.start + t.num_sampled] for t in traj.turns]


async def test_multi_turn_ids_and_logprobs_are_the_engines_verbatim(codec: ChatCodec) -> None:
    traj, engine, env = await play(
        codec, [call("add", '{"a": 2, "b": 3}'), "<think>ok</think> <answer>5</answer>"]
    )

    assert (traj.status, traj.status_reason, traj.reward, traj.num_turns) == (
        EpisodeStatus.COMPLETED,
        StatusReason.DONE,
        1.0,
        2,
    )
    assert sampled_spans(traj) == [c.ids for c in engine.completions]
    assert traj.logprobs == [lp for c in engine.completions for lp in c.logprobs]
    # mask 1 on exactly the sampled positions
    sampled_positions = {t.start + k for t in traj.turns for k in range(t.num_sampled)}
    assert {i for i, m in enumerate(traj.loss_mask) if m} == sampled_positions
    # the engine saw exactly the trajectory's context, every turn
    assert [ids for ids, _ in engine.calls] == [traj.token_ids[: t.start] for t in traj.turns]
    # the spelled-out ids are not what tokenizing the text would give: nothing was re-tokenized
    assert codec.encode(codec.decode(engine.completions[0].ids)) != engine.completions[0].ids
    assert traj.token_ids[: traj.prompt_len] == codec.render_prompt(
        [Message("system", "Use the tools."), Message("user", "What is 2 + 3?")],
        env.tools.schemas(),
    )
    first = traj.turns[0]
    observation = traj.token_ids[first.start + first.num_sampled : traj.turns[1].start]
    assert "<tool_response>" not in codec.decode(observation)  # SmolLM2 renders role "tool"
    assert codec.decode(observation) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert (
        first.num_tool_calls,
        first.num_tool_errors,
        first.weight_version,
        first.finish_reason,
    ) == (1, 0, 7, "stop")
    assert env.events == ["reset", "step", "step", "close"]
    assert env.tools.tokenizer is codec  # tools cut their output in the policy's tokens
    assert traj.info["correct"] is True and traj.task["id"] == "t0" and traj.episode_id == "g/0"


async def test_turn_without_eos_gets_end_of_turn_appended_masked(
    codec: ChatCodec, smol_tokenizer: Any
) -> None:
    engine = ScriptedEngine(
        smol_tokenizer, [call("add", '{"a": 1, "b": 1}'), "<answer>2</answer>"], eos=False
    )
    traj, engine, _ = await play(codec, [], engine=engine)
    first = traj.turns[0]
    eot = traj.token_ids[first.start + first.num_sampled]
    assert (
        eot == smol_tokenizer.eos_token_id and traj.loss_mask[first.start + first.num_sampled] == 0
    )
    assert sampled_spans(traj) == [c.ids for c in engine.completions]


@pytest.mark.parametrize(
    ("bad_call", "error_kind_text"),
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>', "malformed JSON"),
        (call("multiply", '{"a": 1, "b": 2}'), "unknown tool 'multiply'"),
        (call("add", '{"a": "one", "b": 2}'), "invalid arguments for tool 'add'"),
        (call("explode", '{"reason": "test"}'), "RuntimeError: kaboom: test"),
        (call("stall", '{"seconds": 5}'), "timed out"),
    ],
    ids=["malformed-json", "unknown-tool", "bad-arguments", "tool-exception", "tool-timeout"],
)
async def test_tool_failures_become_observations_and_the_episode_continues(
    codec: ChatCodec, bad_call: str, error_kind_text: str
) -> None:
    traj, _, _ = await play(codec, [bad_call, "<answer>5</answer>"])
    assert (traj.status, traj.num_turns, traj.reward) == (EpisodeStatus.COMPLETED, 2, 1.0)
    first = traj.turns[0]
    observation = codec.decode(
        traj.token_ids[first.start + first.num_sampled : traj.turns[1].start]
    )
    assert error_kind_text in observation
    assert (first.num_tool_calls, first.num_tool_errors) == (1, 1)


@pytest.mark.parametrize("where", ["reset", "step"])
async def test_env_exception_ends_the_episode_with_error(
    codec: ChatCodec, where: str, caplog: Any
) -> None:
    env = ToolEnv(fail_on=where)
    traj, _, _ = await play(codec, ["<answer>5</answer>"], env=env)
    assert (traj.status, traj.status_reason) == (EpisodeStatus.ERROR, StatusReason.ENV)
    assert f"{where} failed on purpose" in traj.info["error"] and "Traceback" in traj.info["error"]
    assert traj.info["error_where"] == f"env.{where}"
    assert env.events[-1] == "close"
    assert f"env.{where} raised" in caplog.text


async def test_engine_error_gives_error_engine(codec: ChatCodec) -> None:
    traj, _, env = await play(codec, [call("add", '{"a": 2, "b": 3}'), EngineError("server down")])
    assert (traj.status, traj.status_reason, traj.num_turns) == (
        EpisodeStatus.ERROR,
        StatusReason.ENGINE,
        1,
    )
    assert "server down" in traj.info["error"] and env.events[-1] == "close"


async def test_max_turns_truncates(codec: ChatCodec) -> None:
    traj, engine, _ = await play(codec, ["thinking..."], max_turns=3)
    assert (traj.status, traj.status_reason, traj.num_turns) == (
        EpisodeStatus.TRUNCATED,
        StatusReason.MAX_TURNS,
        3,
    )
    assert traj.turns[-1].num_observation == 0 and len(engine.calls) == 3


async def test_an_answer_on_the_last_turn_completes(codec: ChatCodec) -> None:
    traj, _, _ = await play(codec, ["thinking...", "<answer>5</answer>"], max_turns=2)
    assert (traj.status, traj.status_reason, traj.num_turns) == (
        EpisodeStatus.COMPLETED,
        StatusReason.DONE,
        2,
    )


class SelfTruncatingEnv(ToolEnv):
    """Ends the episode truncated itself on its second step, with `reason` (as search_r1 does at
    its own turn limit)."""

    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason

    async def step(self, action: Message) -> StepResult:
        result = await super().step(action)
        if len(self.actions) == 2:
            result.truncated = True
            result.info["truncated_reason"] = self.reason
        return result


@pytest.mark.parametrize(
    ("reason", "recorded"),
    [("context", StatusReason.CONTEXT), ("no such reason", StatusReason.MAX_TURNS)],
)
async def test_an_env_truncating_itself_keeps_its_reason(
    codec: ChatCodec, reason: str, recorded: StatusReason
) -> None:
    env = SelfTruncatingEnv(reason)
    traj, _, _ = await play(codec, ["thinking..."], env=env, max_turns=10)
    assert (traj.status, traj.status_reason, traj.num_turns) == (
        EpisodeStatus.TRUNCATED,
        recorded,
        2,
    )


async def test_context_overflow_truncates_and_never_exceeds_the_window(codec: ChatCodec) -> None:
    prompt_len = len(
        codec.render_prompt(
            [Message("system", "Use the tools."), Message("user", "What is 2 + 3?")],
            ToolEnv().tools,
        )
    )
    engine = ScriptedEngine(codec.tokenizer, [call("add", '{"a": 2, "b": 3}')])
    num_sampled = len(engine.spell(call("add", '{"a": 2, "b": 3}'))) + 1  # + eos
    limit = prompt_len + num_sampled + 5  # the turn fits, its observation does not
    traj, engine, _ = await play(codec, [], engine=engine, max_context_len=limit)
    assert (traj.status, traj.status_reason) == (EpisodeStatus.TRUNCATED, StatusReason.CONTEXT)
    assert len(traj.token_ids) <= limit
    # every request asked for at most what fits
    assert all(len(ids) + s.max_new_tokens <= limit for ids, s in engine.calls)


async def test_length_cut_on_the_last_budget_truncates_with_length(codec: ChatCodec) -> None:
    prompt_len = len(
        codec.render_prompt(
            [Message("system", "Use the tools."), Message("user", "What is 2 + 3?")],
            ToolEnv().tools,
        )
    )
    traj, engine, _ = await play(codec, ["x" * 50], max_context_len=prompt_len + 20)
    assert (traj.status, traj.status_reason) == (EpisodeStatus.TRUNCATED, StatusReason.LENGTH)
    assert engine.calls[0][1].max_new_tokens == 20 and len(traj.token_ids) == prompt_len + 20
    assert traj.turns[0].finish_reason == FinishReason.LENGTH.value


async def test_wall_clock_truncates_and_closes_the_env(
    codec: ChatCodec, smol_tokenizer: Any
) -> None:
    engine = ScriptedEngine(smol_tokenizer, [call("add", '{"a": 2, "b": 3}')], delay_s=0.02)
    traj, _, env = await play(codec, [], engine=engine, timeout_s=0.1, max_turns=100)
    assert (traj.status, traj.status_reason) == (EpisodeStatus.TRUNCATED, StatusReason.WALL_CLOCK)
    assert traj.num_turns >= 1 and env.events[-1] == "close"


class StuckEnv(ToolEnv):
    async def step(self, action: Message) -> StepResult:
        self.events.append("step")
        await asyncio.sleep(3600)
        return StepResult()


async def test_wall_clock_cancels_a_step_that_outlives_it(codec: ChatCodec) -> None:
    traj, _, env = await play(codec, ["thinking..."], env=StuckEnv(), timeout_s=0.1)
    assert (traj.status, traj.status_reason) == (EpisodeStatus.TRUNCATED, StatusReason.WALL_CLOCK)
    assert traj.num_turns == 1 and env.events == ["reset", "step", "close"]


async def test_cancellation_aborts_and_keeps_what_was_sampled(
    codec: ChatCodec, smol_tokenizer: Any
) -> None:
    engine = ScriptedEngine(smol_tokenizer, ["thinking..."], delay_s=0.02)
    env = ToolEnv()
    task = asyncio.ensure_future(play(codec, [], engine=engine, env=env, max_turns=100))
    await asyncio.sleep(0.1)
    task.cancel()
    traj, _, _ = await task
    assert (traj.status, traj.status_reason) == (EpisodeStatus.ABORTED, StatusReason.CANCELLED)
    assert traj.num_turns >= 1 and env.events[-1] == "close"


async def test_abort_finish_reason_aborts(codec: ChatCodec, smol_tokenizer: Any) -> None:
    aborted = Completion([], [], FinishReason.ABORT, 7)
    traj, _, _ = await play(codec, [aborted])
    assert (traj.status, traj.status_reason) == (EpisodeStatus.ABORTED, StatusReason.CANCELLED)


async def test_sampling_gets_env_stop_strings_eos_and_per_turn_seeds(codec: ChatCodec) -> None:
    env = ToolEnv(stop=("</search>",))
    sampling = SamplingParams(max_new_tokens=200, stop=["</answer>"], seed=11)
    _, engine, _ = await play(codec, ["hmm", "<answer>5</answer>"], env=env, sampling=sampling)
    first, second = (s for _, s in engine.calls)
    assert first.stop == ["</answer>", "</search>"]
    assert codec.tokenizer.eos_token_id in first.stop_token_ids
    assert first.seed == 11 and second.seed != 11


async def test_long_observations_are_cut_keeping_head_and_tail(codec: ChatCodec) -> None:
    traj, _, _ = await play(
        codec, [call("dump", '{"size": 400}'), "<answer>5</answer>"], max_observation_tokens=60
    )
    first = traj.turns[0]
    text = codec.decode(traj.token_ids[first.start + first.num_sampled : traj.turns[1].start])
    assert "line 0" in text and "line 399" in text and "line 200" not in text
    assert "tokens truncated" in text
    assert first.num_observation < 60 + 12  # the budget and the role tokens


async def test_the_env_declares_its_observation_budget(codec: ChatCodec) -> None:
    """The smaller of the env's budget and the runner's applies; the env holds no tokenizer."""
    replies = [call("dump", '{"size": 400}'), "<answer>5</answer>"]
    lengths = []
    for env_budget, runner_budget in [(60, None), (60, 1000), (1000, 60), (None, None)]:
        env = ToolEnv()
        env.max_observation_tokens = env_budget
        traj, _, _ = await play(codec, replies, env=env, max_observation_tokens=runner_budget)
        lengths.append(traj.turns[0].num_observation)
    assert lengths[0] == lengths[1] == lengths[2] < 60 + 12 < lengths[3]


async def test_each_turn_records_its_sampling_and_the_versions_of_its_tokens(
    codec: ChatCodec,
) -> None:
    """A first turn retracted mid-way and finished under new weights (3 then 5): its spans are
    kept, and the staleness bound judges the trajectory by its oldest token, not the turn's
    last version (slime #2092)."""
    engine = ScriptedEngine(codec.tokenizer, [])
    first_ids = engine.spell(call("add", '{"a": 2, "b": 3}')) + [codec.tokenizer.eos_token_id]
    last_ids = engine.spell("<answer>5</answer>") + [codec.tokenizer.eos_token_id]
    straddled = Completion(
        first_ids,
        [-0.5] * len(first_ids),
        FinishReason.STOP,
        5,
        version_spans=[(3, 4), (5, len(first_ids) - 4)],
        is_logprob_truncated=True,
    )
    engine.replies = [
        straddled,
        Completion(last_ids, [-0.5] * len(last_ids), FinishReason.STOP, 5),
    ]
    sampling = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=200, seed=1)
    traj, _, _ = await play(codec, [], engine=engine, sampling=sampling)
    first, last = traj.turns
    assert (first.temperature, first.top_k, first.top_p) == (0.8, 20, 0.9)
    assert first.is_logprob_truncated and not last.is_logprob_truncated
    assert first.token_versions() == [3] * 4 + [5] * (len(first_ids) - 4)
    assert last.version_spans == [] and last.token_versions() == [5] * len(last_ids)
    assert drop_stale([[traj]], trainer_version=5, max_staleness=1) == ([], 1)
    assert drop_stale([[traj]], trainer_version=5, max_staleness=2) == ([[traj]], 0)
