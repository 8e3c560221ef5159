"""`AgentEnv`: sync subclasses run off the event loop; `call_tools` returns ToolResults."""

from __future__ import annotations

import asyncio
import threading
import time

from agentrl.envs import AgentEnv, StepResult, tool_info
from agentrl.tools import ToolResult, tool
from agentrl.types import Message, ToolCall


class SleepyEnv(AgentEnv):
    """A synchronous env whose step blocks, as a naive user env would."""

    def reset(self, *, seed=None, options=None):
        return [Message(role="user", content="hi")], {"thread": threading.current_thread().name}

    def step(self, action):
        time.sleep(0.3)
        return StepResult(
            reward=1.0, terminated=True, info={"thread": threading.current_thread().name}
        )


async def test_sync_env_runs_off_the_event_loop() -> None:
    env = SleepyEnv()
    messages, info = await env.reset(seed=0)
    assert messages[0].content == "hi"
    assert info["thread"] != threading.current_thread().name
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        for _ in range(5):
            await asyncio.sleep(0.02)
            ticks += 1

    result, _ = await asyncio.gather(env.step(Message(role="assistant", content="x")), ticker())
    assert ticks == 5  # the loop kept running while step slept
    assert result.reward == 1.0 and result.info["thread"] != threading.current_thread().name


@tool
def double(x: int) -> int:
    return 2 * x


class ToolEnv(AgentEnv):
    def __init__(self) -> None:
        super().__init__()
        self.tools.register(double)


async def test_call_tools_returns_results_in_call_order_with_errors_as_results() -> None:
    env = ToolEnv()
    action = Message(
        role="assistant",
        tool_calls=[
            ToolCall("double", '{"x": 4}', "a"),
            ToolCall("missing", "{}", "b"),
            ToolCall("double", "{", "c"),
        ],
    )
    results = await env.call_tools(action)
    assert all(isinstance(r, ToolResult) for r in results)
    assert [r.message.tool_call_id for r in results] == ["a", "b", "c"]
    assert [r.error_kind for r in results] == [None, "unknown_tool", "malformed_json"]
    assert results[0].content == "8"
    assert tool_info(results) == {"num_tool_calls": 3, "num_tool_errors": 2}


def test_step_result_unpacks_like_gymnasium() -> None:
    observation, reward, terminated, truncated, info = StepResult(
        reward=0.5, truncated=True, info={"k": 1}
    )
    assert (observation, reward, terminated, truncated, info) == ([], 0.5, False, True, {"k": 1})
