"""Agent fixtures: an agent written only against the `openai` package (a tool loop), and the
tokenizer dressed with a template that renders tool calls."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentrl.agents import AgentEndpoint, AgentEpisode, run_agent_episode
from agentrl.engine.base import SamplingParams
from agentrl.envs.builtin.calculator import CalculatorEnv
from agentrl.rollout.agent_endpoint.chat import CallLimits
from agentrl.rollout.codec import ChatCodec
from agentrl.types import Task
from tests.rollout.conftest import load_tokenizer

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


async def tool_agent(task: Any, client: Any) -> float:
    """A plain OpenAI-client tool loop of up to 3 calls: it runs `add` for every tool call and
    nudges a model that called no tool (a random one never does) with a user message."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Use the add tool, then answer."},
        {"role": "user", "content": task.data["question"]},
    ]
    for _ in range(3):
        response = await client.chat.completions.create(
            model="policy", messages=messages, tools=[ADD_TOOL], max_tokens=128
        )
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if str(task.data["answer"]) in (message.content or ""):
            return 1.0
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": _add(call)})
        if not message.tool_calls:
            messages.append({"role": "user", "content": "Use the add tool."})
    return 0.0


def _add(call: Any) -> str:
    try:
        args = json.loads(call.function.arguments)
        return str(int(args["a"]) + int(args["b"]))
    except (ValueError, KeyError, TypeError) as e:
        return f"error: {e}"


@pytest.fixture(scope="session")
def qwen_tokenizer(smollm2_path: str) -> Any:
    return load_tokenizer(smollm2_path, "qwen_tools")


AGENT_TASK = Task(id="t0", data={"question": "What is 2 + 3?", "answer": 5})


async def run_agent_once(
    engine: Any,
    codec: ChatCodec,
    agent: Any,
    *,
    env: Any = None,
    max_new_tokens: int = 256,
    **limits: Any,
) -> list:
    """One agent episode on AGENT_TASK through a fresh endpoint: its trajectories (segments)."""
    endpoint = AgentEndpoint(engine)
    await endpoint.start()
    try:
        setup = AgentEpisode(
            endpoint,
            codec,
            CallLimits(limits.get("max_calls", 4), limits.get("max_context_len", 4096)),
            timeout_s=limits.get("timeout_s", 60),
        )
        sampling = SamplingParams(
            max_new_tokens=max_new_tokens, seed=1, stop_token_ids=codec.stop_token_ids
        )
        return await run_agent_episode(
            agent,
            setup,
            env or CalculatorEnv(),
            AGENT_TASK,
            sampling,
            group_id="g",
            episode_id="g/0",
        )
    finally:
        await endpoint.stop()
