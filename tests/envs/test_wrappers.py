"""Wrappers truncate with a reason and otherwise pass everything to the wrapped env."""

from __future__ import annotations

import asyncio
from typing import ClassVar

import pytest

from agentrl.envs import AgentEnv, MaxTurns, StepResult, TokenBudget, WallClock
from agentrl.tools import tool
from agentrl.types import Message, StatusReason

ACTION = Message(role="assistant", content="word " * 10)


@tool
def noop() -> str:
    return ""


class CountingEnv(AgentEnv):
    """Never ends by itself unless the action says "stop"; each step can be made slow."""

    reward_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    stop: ClassVar[tuple[str, ...]] = ("</x>",)

    def __init__(self, step_delay_s: float = 0.0) -> None:
        super().__init__()
        self.tools.register(noop)
        self.step_delay_s = step_delay_s
        self.custom = "delegated"

    async def reset(self, *, seed=None, options=None):
        return [Message(role="user", content="go")], {}

    async def step(self, action):
        await asyncio.sleep(self.step_delay_s)
        return StepResult(
            terminated=action.content == "stop", reward=1.0 if action.content == "stop" else 0.0
        )


async def run_steps(env: AgentEnv, n: int, action: Message = ACTION) -> list[StepResult]:
    await env.reset(seed=0)
    return [await env.step(action) for _ in range(n)]


async def test_max_turns_truncates_on_the_nth_step_with_reason() -> None:
    results = await run_steps(MaxTurns(CountingEnv(), 3), 3)
    assert [r.truncated for r in results] == [False, False, True]
    assert results[-1].info["truncated_reason"] == StatusReason.MAX_TURNS.value == "max_turns"


async def test_max_turns_counts_from_each_reset_and_keeps_termination() -> None:
    env = MaxTurns(CountingEnv(), 2)
    await run_steps(env, 2)
    results = await run_steps(env, 1)
    assert not results[0].truncated  # the count restarted at reset
    result = (await run_steps(env, 2, Message(role="assistant", content="stop")))[-1]
    assert result.terminated and not result.truncated and "truncated_reason" not in result.info


async def test_wall_clock_truncates_after_the_deadline() -> None:
    env = WallClock(CountingEnv(step_delay_s=0.05), seconds=0.12)
    results = await run_steps(env, 4)
    assert any(r.truncated for r in results)
    first = next(r for r in results if r.truncated)
    assert first.info["truncated_reason"] == StatusReason.WALL_CLOCK.value


async def test_wall_clock_cancels_a_step_that_outlives_the_deadline() -> None:
    env = WallClock(CountingEnv(step_delay_s=10.0), seconds=0.1)
    result = (await run_steps(env, 1))[0]
    assert result.truncated and result.info["truncated_reason"] == "wall_clock"


async def test_token_budget_truncates_with_length_reason() -> None:
    env = TokenBudget(CountingEnv(), max_tokens=25)  # each action: 50 characters ~ 13 tokens
    results = await run_steps(env, 2)
    assert [r.truncated for r in results] == [False, True]
    assert results[1].info["truncated_reason"] == StatusReason.LENGTH.value


async def test_token_budget_counts_with_the_bound_tokenizer() -> None:
    class WordTokenizer:
        def encode(self, text, add_special_tokens=False):
            return text.split()

    env = TokenBudget(CountingEnv(), max_tokens=20)
    env.tools.tokenizer = WordTokenizer()  # what the runner binds: its chat codec
    results = await run_steps(env, 2)  # 10 words per action
    assert [r.truncated for r in results] == [False, True]
    assert env.unwrapped.tools.tokenizer is not None


def test_wrappers_delegate_tools_and_attributes() -> None:
    inner = CountingEnv()
    env = TokenBudget(WallClock(MaxTurns(inner, 2), 10.0), 100)
    assert env.tools is inner.tools and env.tools.names == ["noop"]
    assert env.reward_range == (0.0, 1.0) and env.stop == ("</x>",)
    assert env.custom == "delegated" and env.unwrapped is inner
    assert env.env.env.max_turns == 2
    with pytest.raises(AttributeError):
        _ = env.missing_attribute


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda e: MaxTurns(e, 0), "max_turns"),
        (lambda e: WallClock(e, 0), "seconds"),
        (lambda e: TokenBudget(e, 0), "max_tokens"),
    ],
)
def test_bad_limits_are_rejected(make, match) -> None:
    with pytest.raises(ValueError, match=match):
        make(CountingEnv())
