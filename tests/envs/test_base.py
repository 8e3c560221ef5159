"""`AgentEnv`: sync subclasses run off the event loop; `call_tools` returns ToolResults."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

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


def test_default_task_from_row_keeps_the_rows_fields_and_its_id() -> None:
    task = SleepyEnv.task_from_row({"id": 7, "country": "Kenya"}, index=3)
    assert (task.id, task.data) == ("7", {"id": 7, "country": "Kenya"})
    prompt = SleepyEnv.task_from_row({"prompt": "2+2?", "label": "4"}, index=3)
    assert prompt.id == "row-3"
    assert (prompt.data["question"], prompt.data["answer"]) == ("2+2?", "4")


def test_default_task_from_row_reads_the_named_keys() -> None:
    task = SleepyEnv.task_from_row({"q": "x?", "a": "y"}, index=0, input_key="q", label_key="a")
    assert task.data == {"q": "x?", "a": "y", "question": "x?", "answer": "y"}


def test_a_named_key_the_row_lacks_is_one_line_naming_the_flag_and_the_method() -> None:
    with pytest.raises(ValueError) as err:
        SleepyEnv.task_from_row({"q": "x?"}, index=4, label_key="gold")
    message = str(err.value)
    assert "\n" not in message and "row 4: no field 'gold' (fields: ['q'])" in message
    assert "--label-key" in message and "SleepyEnv.task_from_row" in message
