"""The calculator's reward (`score`) and its lenient reading of near-miss calls (`repair_call`),
on hand-computed cases."""

from __future__ import annotations

import json

import pytest

from agentrl.envs import make
from agentrl.envs.builtin.calculator import FORMAT_WEIGHT, repair_call, score
from agentrl.types import Message, Task, ToolCall

TASK = Task(
    id="t", data={"question": "There are 37 boxes of 24 pens. How many pens?", "answer": 888}
)


@pytest.mark.parametrize(
    ("predicted", "tag", "after_tool", "reward"),
    [
        (888.0, True, True, 1.0),
        (888.0, False, False, 1.0),  # right without the tool or the tag: still right
        (61.0, True, True, FORMAT_WEIGHT),  # called, read the result, wrong expression
        (61.0, False, True, 0.0),  # no tag: no format credit
        (61.0, True, False, 0.0),  # a guess in tags earns nothing
        (None, True, True, FORMAT_WEIGHT),  # '<answer></answer>' after a result
        (None, False, False, 0.0),
    ],
)
def test_score(predicted: float | None, tag: bool, after_tool: bool, reward: float) -> None:
    assert score(predicted, 888, has_answer_tag=tag, after_tool_result=after_tool) == reward


def test_score_format_weight_zero_pays_only_the_right_answer() -> None:
    assert score(1.0, 888, has_answer_tag=True, after_tool_result=True, format_weight=0.0) == 0


@pytest.mark.parametrize(
    ("name", "arguments", "expression"),
    [
        ("calculate", '{"expression": "37 * 24"}', None),  # well formed: unchanged
        ("calculate", '{"value": "37 * 24"}', "37 * 24"),
        ("", '{"answer": "119 + 120"}}', "119 + 120"),
        ("calculate", '{"name": "calculate", "arguments": {"expression": "3*4"}}}', "3*4"),
        ("calculate", '{"value": "15"}', None),  # no operation: left for the registry's error
        ("search", '{"query": "1 + 1"}', None),  # another tool: not ours to read
        ("", "illuminating\n226\n<answer>226</answer>", None),
    ],
)
def test_repair_call(name: str, arguments: str, expression: str | None) -> None:
    call = ToolCall(name, arguments, "c1")
    repaired = repair_call(call)
    if expression is None:
        assert repaired == call
    else:
        assert repaired.name == "calculate" and repaired.id == "c1"
        assert json.loads(repaired.arguments) == {"expression": expression}


async def test_a_near_miss_call_is_answered_and_the_answer_after_it_earns_format() -> None:
    env = make("calculator")
    await env.reset(options={"task": TASK})
    call = ToolCall("calculate", '{"value": "37 + 24"}', "c1")  # the wrong operation
    step = await env.step(Message(role="assistant", tool_calls=[call]))
    assert [m.content for m in step.observation] == ["61"] and step.info["num_tool_errors"] == 0
    end = await env.step(Message(role="assistant", content="<answer>61</answer>"))
    assert end.terminated and end.reward == FORMAT_WEIGHT and end.info["correct"] is False
    assert end.info["reward_components"] == {
        "correct": False,
        "used_tool": True,
        "answer_after_tool": True,
    }


async def test_strict_calls_leave_near_misses_as_errors_and_earn_nothing() -> None:
    env = make("calculator", lenient_calls=False)
    await env.reset(options={"task": TASK})
    call = ToolCall("calculate", '{"value": "37 * 24"}', "c1")
    step = await env.step(Message(role="assistant", tool_calls=[call]))
    assert step.info["num_tool_errors"] == 1
    end = await env.step(Message(role="assistant", content="<answer>61</answer>"))
    assert end.reward == 0.0  # an error result is not a tool result to answer from


async def test_a_new_episode_forgets_the_last_ones_tool_results() -> None:
    env = make("calculator")
    await env.reset(options={"task": TASK})
    await env.step(
        Message(role="assistant", tool_calls=[ToolCall("calculate", '{"expression": "1+1"}', "c")])
    )
    await env.reset(options={"task": TASK})
    end = await env.step(Message(role="assistant", content="<answer>2</answer>"))
    assert end.reward == 0.0


def test_format_weight_must_stay_below_a_right_answer() -> None:
    with pytest.raises(ValueError, match=r"format_weight=1.0: use a value in \[0, 1\)"):
        make("calculator", format_weight=1.0)
