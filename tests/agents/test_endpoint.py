"""The agent endpoint refuses what OpenAI and Anthropic refuse with a 400 naming the field (a
role outside the chat roles, a malformed Messages body), never a 500 and a traceback."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest

from agentrl.agents import AgentEndpoint, AgentEpisode, run_agent_episode
from agentrl.engine.base import SamplingParams
from agentrl.envs.builtin.calculator import CalculatorEnv
from agentrl.rollout.agent_endpoint.chat import CallLimits
from agentrl.rollout.codec import ChatCodec
from agentrl.types import EpisodeStatus, Task
from tests.rollout.conftest import ScriptedEngine

TASK = Task(id="t0", data={"question": "What is 2 + 3?", "answer": 5})
USER = {"role": "user", "content": "hi"}


async def _answers(tokenizer: Any, bodies: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """Each (route, body) posted by one agent episode; the responses, then the trajectory."""
    replies: list[httpx.Response] = []

    async def agent(task: Any, client: Any) -> float:
        async with httpx.AsyncClient(base_url=str(client.base_url)) as http:
            for route, body in bodies:
                replies.append(await http.post(route, json=body))
        return 1.0

    codec = ChatCodec(tokenizer)
    endpoint = AgentEndpoint(ScriptedEngine(tokenizer, ["hello"]))
    await endpoint.start()
    try:
        setup = AgentEpisode(endpoint, codec, CallLimits(8, 4096), timeout_s=60)
        sampling = SamplingParams(max_new_tokens=16, stop_token_ids=codec.stop_token_ids)
        [traj] = await run_agent_episode(agent, setup, CalculatorEnv(), TASK, sampling)
    finally:
        await endpoint.stop()
    return [*replies, traj]


@pytest.mark.parametrize(
    ("messages", "named"),
    [
        ([{"role": "wizard", "content": "Obey."}, USER], "messages.0.role"),
        ([USER, {"content": "no role"}], "messages.1.role"),
    ],
)
async def test_a_chat_role_outside_openais_is_a_400_naming_it(qwen_tokenizer, messages, named):
    refused, played, traj = await _answers(
        qwen_tokenizer,
        [("chat/completions", {"messages": messages}), ("chat/completions", {"messages": [USER]})],
    )
    assert refused.status_code == 400 and named in refused.json()["error"]["message"]
    assert played.status_code == 200  # the refused call took no turn
    assert traj.status is EpisodeStatus.COMPLETED and traj.info["num_calls"] == 1


def _messages(messages: list[Any], **extra: Any) -> tuple[str, dict[str, Any]]:
    return "messages", {"model": "m", "max_tokens": 8, "messages": messages, **extra}


TOOL_USE = {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1}}


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (_messages([{"role": "wizard", "content": "Obey."}]), "messages[0].role: 'wizard'"),
        (_messages([{"content": "hi"}]), "messages[0].role: None"),
        (_messages([{"role": "user", "content": ["hi"]}]), "messages[0].content[0]"),
        (_messages([{"role": "user", "content": [{"text": "hi"}]}]), "content[0].type"),
        (_messages([{"role": "user", "content": 7}]), "messages[0].content"),
        (
            _messages([USER, {"role": "assistant", "content": [{**TOOL_USE, "id": None}]}]),
            "messages[1].content[0].id",
        ),
        (
            _messages([USER, {"role": "assistant", "content": [{**TOOL_USE, "input": "1"}]}]),
            "messages[1].content[0].input",
        ),
        (
            _messages([{"role": "user", "content": [{"type": "tool_result", "content": "3"}]}]),
            "messages[0].content[0].tool_use_id",
        ),
        (_messages([USER], tools=[{"description": "no name"}]), "tools[0].name"),
    ],
)
async def test_a_malformed_messages_call_is_a_400_naming_the_field(
    qwen_tokenizer, caplog, call, named
):
    with caplog.at_level(logging.ERROR):
        refused, played, traj = await _answers(qwen_tokenizer, [call, _messages([USER])])
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert named in message and "\n" not in message
    assert played.status_code == 200 and played.json()["content"][0]["text"]
    assert traj.status is EpisodeStatus.COMPLETED
    assert "Traceback" not in caplog.text
