"""Rewards enter an episode as finite numbers or end it ERROR/non_finite_reward: a NaN or inf
from an env (local or served: JSON accepts NaN), or a sum that overflows, is never scored."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import httpx
import pytest

from agentrl.engine.base import SamplingParams
from agentrl.envs.base import StepResult
from agentrl.envs.remote import RemoteEnv
from agentrl.rollout.codec import ChatCodec
from agentrl.rollout.episode import run_episode
from agentrl.types import EpisodeStatus, Message, StatusReason

from .conftest import TASK, ScriptedEngine, ToolEnv


class PayingEnv(ToolEnv):
    """Pays `rewards[k]` on its k-th step and ends after the last."""

    def __init__(self, rewards: list[Any]) -> None:
        super().__init__()
        self.rewards = rewards

    async def step(self, action: Message) -> StepResult:
        self.events.append("step")
        k = self.events.count("step") - 1
        is_last = k == len(self.rewards) - 1
        return StepResult([Message("user", "go on")], self.rewards[k], terminated=is_last)


async def _play(env: Any, codec: ChatCodec, num_turns: int = 3):
    return await run_episode(
        env,
        ScriptedEngine(codec.tokenizer, ["thinking"]),
        codec,
        TASK,
        SamplingParams(max_new_tokens=32, seed=1),
        max_turns=num_turns,
        max_context_len=4096,
        group_id="g",
        episode_id="g/0",
    )


@pytest.mark.parametrize(
    ("rewards", "shown"),
    [
        ([0.5, math.nan], "nan"),
        ([math.inf], "inf"),
        ([1.0, -math.inf], "-inf"),
        (["1e999"], "'1e999'"),  # a number past the float range, as text
        ([None], "None"),
        ([1e308, 1e308], "inf"),  # finite steps whose sum overflows
    ],
)
async def test_a_reward_that_is_no_finite_number_ends_the_episode_error(
    smol_tokenizer: Any, caplog: Any, rewards: list[Any], shown: str
) -> None:
    env = PayingEnv(rewards)
    with caplog.at_level(logging.WARNING):
        traj = await _play(env, ChatCodec(smol_tokenizer))
    assert (traj.status, traj.status_reason) == (
        EpisodeStatus.ERROR,
        StatusReason.NON_FINITE_REWARD,
    )
    assert traj.reward == 0.0 and not traj.status.is_trainable
    assert traj.num_turns == len(rewards) and env.events[-1] == "close"
    assert traj.info["non_finite_reward"] == shown
    assert traj.info["error_where"] in (
        "PayingEnv.step on task 't0'",
        "PayingEnv's rewards summed on task 't0'",  # finite steps whose sum overflows
    )
    [line] = [r.getMessage() for r in caplog.records if "not a finite number" in r.getMessage()]
    assert "episode g/0" in line and f"gave reward {shown}" in line and "\n" not in line


async def test_finite_rewards_still_add_up(smol_tokenizer: Any) -> None:
    traj = await _play(PayingEnv([0.25, 1, True]), ChatCodec(smol_tokenizer))
    assert (traj.status, traj.reward) == (EpisodeStatus.COMPLETED, 2.25)


async def test_a_served_env_paying_nan_ends_the_episode_error(smol_tokenizer: Any) -> None:
    """`agentrl env serve` answers JSON, and Python's JSON reads NaN: the runner catches it."""

    def server(request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path == "/sessions":
            body = {"session_id": "s1", "messages": [{"role": "user", "content": "2 + 3?"}]}
            return httpx.Response(200, content=json.dumps(body).encode())
        if request.url.path == "/sessions/s1/step":
            text = '{"observation": [], "reward": NaN, "terminated": true, "truncated": false}'
            return httpx.Response(200, content=text.encode())
        return httpx.Response(200, json={})

    env = RemoteEnv("http://env.invalid")
    # The session's calls go to `server`, in process.
    env._client = httpx.AsyncClient(base_url=env.url, transport=httpx.MockTransport(server))
    traj = await _play(env, ChatCodec(smol_tokenizer))
    assert (traj.status, traj.status_reason, traj.reward) == (
        EpisodeStatus.ERROR,
        StatusReason.NON_FINITE_REWARD,
        0.0,
    )
    assert "RemoteEnv.step" in traj.info["error_where"]
