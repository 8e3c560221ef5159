"""`run_agent_episode`'s outcomes: an agent's reward is a finite number or the episode is ERROR,
its calls never pass `max_turns` however many it makes at once, and its timeout holds even
against an agent that swallows its cancellation."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import pytest

from agentrl.agents import AgentResult
from agentrl.envs.base import StepResult
from agentrl.envs.builtin.calculator import CalculatorEnv
from agentrl.rollout.codec import ChatCodec
from agentrl.types import EpisodeStatus, Message, StatusReason, Task
from tests.agents.conftest import run_agent_once
from tests.rollout.conftest import ScriptedEngine

TASK = Task(id="t0", data={"question": "What is 2 + 3?", "answer": 5})
HI = [{"role": "user", "content": "hi"}]


async def _run(tokenizer: Any, agent: Any, *, env: Any = None, **limits: Any) -> list:
    engine = ScriptedEngine(tokenizer, ["x"], delay_s=limits.get("delay_s", 0.0))
    codec = ChatCodec(tokenizer)
    trajectories = await run_agent_once(engine, codec, agent, env=env, max_new_tokens=16, **limits)
    return [*trajectories, engine]


def paying(value: Any) -> Any:
    async def agent(task: Any, client: Any) -> Any:
        await client.chat.completions.create(model="p", messages=HI)
        return value

    return agent


class NanScoringEnv(CalculatorEnv):
    async def step(self, action: Message) -> StepResult:
        return StepResult(reward=math.nan, terminated=True)


@pytest.mark.parametrize(
    ("result", "env", "shown"),
    [
        (math.nan, None, "nan"),
        (math.inf, None, "inf"),
        (AgentResult(reward=-math.inf), None, "-inf"),
        (AgentResult(answer="5"), NanScoringEnv(), "nan"),  # the env scores the answer
    ],
)
async def test_an_agent_reward_that_is_no_finite_number_ends_the_episode_error(
    qwen_tokenizer: Any, caplog: Any, result: Any, env: Any, shown: str
) -> None:
    with caplog.at_level(logging.WARNING):
        traj, _ = await _run(qwen_tokenizer, paying(result), env=env)
    assert (traj.status, traj.status_reason) == (
        EpisodeStatus.ERROR,
        StatusReason.NON_FINITE_REWARD,
    )
    assert traj.reward == 0.0 and traj.info["non_finite_reward"] == shown
    assert "on task 't0'" in traj.info["error_where"]
    assert any(f"gave reward {shown}, not a finite number" in r.message for r in caplog.records)


async def test_an_agent_reward_that_is_a_number_is_kept(qwen_tokenizer: Any) -> None:
    traj, _ = await _run(qwen_tokenizer, paying(0.75))
    assert (traj.status, traj.reward) == (EpisodeStatus.COMPLETED, 0.75)


async def test_calls_made_at_once_never_pass_max_turns(qwen_tokenizer: Any) -> None:
    """The turn is taken before the call's first await: 12 calls at once, 3 allowed, 3 played."""
    answers: list[Any] = []

    async def swarm(task: Any, client: Any) -> float:
        calls = [client.chat.completions.create(model="p", messages=HI) for _ in range(12)]
        answers.extend(await asyncio.gather(*calls, return_exceptions=True))
        return 1.0

    *trajectories, engine = await _run(qwen_tokenizer, swarm, max_calls=3)
    assert len(engine.calls) == 3
    assert sum(not isinstance(a, Exception) for a in answers) == 3
    assert sum(t.num_turns for t in trajectories) == 3
    assert trajectories[0].status is EpisodeStatus.TRUNCATED
    assert trajectories[0].status_reason is StatusReason.MAX_TURNS


async def test_an_agent_that_swallows_its_cancellation_still_times_out(qwen_tokenizer: Any) -> None:
    async def stubborn(task: Any, client: Any) -> float:
        await client.chat.completions.create(model="p", messages=HI)
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            return 1.0  # pretends it finished
        return 0.0

    traj, _ = await _run(qwen_tokenizer, stubborn, timeout_s=0.5)
    assert (traj.status, traj.status_reason, traj.reward) == (
        EpisodeStatus.ERROR,
        StatusReason.ENV,
        0.0,
    )
    assert "no result after 0.5s" in traj.info["error_where"]
