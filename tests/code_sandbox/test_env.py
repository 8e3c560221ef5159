"""The code_sandbox env: contract, tasks, the run_python tool and submission rewards."""

from __future__ import annotations

import json

import pytest
from agentrl_envs.code_sandbox import SPEC
from agentrl_envs.code_sandbox.env import CodeSandboxEnv, extract_code

from agentrl.envs import check_env, make
from agentrl.types import Message, ToolCall

from .test_grading import ADD, CORRECT


def test_spec_and_check_env(grading_sandbox) -> None:
    assert SPEC.id == "code_sandbox" and SPEC.load_class() is CodeSandboxEnv
    check_env("code_sandbox")


def test_split_is_seeded_disjoint_and_complete() -> None:
    train, test = CodeSandboxEnv.load_tasks("train"), CodeSandboxEnv.load_tasks("test")
    assert len(train) + len(test) == 164 and len(test) == 33
    assert not {t.id for t in train} & {t.id for t in test}
    assert [t.id for t in CodeSandboxEnv.load_tasks("test")] == [t.id for t in test]
    assert [t.id for t in CodeSandboxEnv.load_tasks("test", seed=1)] != [t.id for t in test]


def test_task_from_row_names_the_missing_field() -> None:
    task = CodeSandboxEnv.task_from_row({**ADD, "task_id": "mine/0"}, index=0)
    assert task.id == "mine/0" and task.data["entry_point"] == "add"
    with pytest.raises(ValueError, match="row 7: field 'test'"):
        CodeSandboxEnv.task_from_row({"prompt": "x", "entry_point": "f"}, index=7)


def test_extract_code_takes_the_last_block() -> None:
    assert extract_code("a\n```python\nx = 1\n```\nthen\n```python\ny = 2\n```") == "y = 2\n"
    assert extract_code("no code") is None


async def _episode(env, reward="all_pass"):
    task = CodeSandboxEnv.task_from_row(ADD, index=0)
    messages, info = await env.reset(options={"task": task})
    assert "def add" in messages[-1].content
    return task


async def test_run_python_tool_then_submission(grading_sandbox) -> None:
    env = make("code_sandbox")
    await _episode(env)
    call = ToolCall(
        name="run_python",
        arguments=json.dumps({"code": "print(2 + 2)\nimport sys; print('e', file=sys.stderr)"}),
        id="c0",
    )
    step = await env.step(Message(role="assistant", content="", tool_calls=[call]))
    assert (
        not step.terminated
        and step.info["num_tool_calls"] == 1
        and step.info["num_tool_errors"] == 0
    )
    text = step.observation[0].content
    assert "status: ok" in text and "4" in text and "e" in text
    final = await env.step(Message(role="assistant", content=f"Done:\n```python\n{CORRECT}```"))
    assert final.terminated and final.reward == 1.0 and final.info["num_passed"] == 3


async def test_rewards_for_no_code_wrong_and_fraction(grading_sandbox) -> None:
    env = make("code_sandbox")
    await _episode(env)
    assert (await env.step(Message(role="assistant", content="it is easy"))).reward == 0.0
    await _episode(env)
    wrong = await env.step(
        Message(role="assistant", content="```python\ndef add(a, b):\n    return 3\n```")
    )
    assert wrong.reward == 0.0 and wrong.info["num_passed"] == 1
    env = make("code_sandbox", reward="fraction")
    await _episode(env)
    frac = await env.step(
        Message(role="assistant", content="```python\ndef add(a, b):\n    return 3\n```")
    )
    assert frac.reward == pytest.approx(1 / 3)


async def test_body_only_completion_is_appended_to_the_prompt(grading_sandbox) -> None:
    env = make("code_sandbox")
    await _episode(env)
    step = await env.step(Message(role="assistant", content="```python\n    return a + b\n```"))
    assert step.reward == 1.0
