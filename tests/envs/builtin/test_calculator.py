"""The built-in calculator env: safe evaluation, exact-answer reward, deterministic splits."""

from __future__ import annotations

import re

import pytest

from agentrl.envs import make
from agentrl.envs.builtin.calculator import (
    CALL_FIRST,
    CalculatorEnv,
    calculate,
    evaluate,
    parse_answer,
)
from agentrl.tools import ToolRegistry
from agentrl.types import Message, Task, ToolCall


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("17 + 25", 42),
        ("(17 + 25) * 3", 126),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("7 % 3", 1),
        ("2 ** 10", 1024),
        ("-3 + +5", 2),
        ("12 × 4", 48),
        ("9 ÷ 3", 3.0),
        ("2^3", 8),
        ("41 + 1 =", 42),
    ],
)
def test_evaluate(expression: str, expected: float) -> None:
    assert evaluate(expression) == expected


@pytest.mark.parametrize(
    ("expression", "match"),
    [
        ("__import__('os').system('true')", "unsupported syntax"),
        ("x + 1", "unsupported syntax 'x'"),
        ("(1).__class__", "unsupported syntax"),
        ("[1, 2]", "unsupported syntax"),
        ("'a' * 3", "unsupported syntax"),
        ("True + 1", "unsupported syntax"),
        ("9 ** 9 ** 9", "exponent .* too large"),
        ("((9 ** 64) ** 64) ** 64", "more than 1000 digits"),
        ("1 + " * 100 + "1", "characters long"),
        ("2 +", "cannot parse"),
        ("", "empty expression"),
    ],
)
def test_evaluate_rejects_anything_but_arithmetic(expression: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        evaluate(expression)


def test_calculate_tool_formats_numbers() -> None:
    assert calculate("6 * 7") == "42"
    assert calculate("10 / 4") == "2.5"
    assert calculate("1 / 3") == "0.3333333333"
    assert calculate("4 / 2") == "2"


async def test_division_by_zero_becomes_an_observation() -> None:
    result = await ToolRegistry([calculate]).call(
        ToolCall("calculate", '{"expression": "1 / 0"}', "c")
    )
    assert result.is_error and result.content == "Error: ZeroDivisionError: division by zero"


TASK = Task(
    id="t1",
    data={
        "question": "Tom has 17 apples and buys 25 more. How many apples does he have?",
        "answer": 42,
    },
)


async def new_episode() -> tuple[CalculatorEnv, list[Message]]:
    env = make("calculator")
    messages, info = await env.reset(seed=0, options={"task": TASK})
    assert info["task_id"] == "t1"
    return env, messages


async def test_reset_gives_system_prompt_worked_episode_and_question() -> None:
    env, messages = await new_episode()
    worked = ["user", "assistant", "tool", "assistant"]
    assert [m.role for m in messages] == ["system", *worked, *worked, "user"]
    assert "<answer>NUMBER</answer>" in messages[0].content and "calculate" in messages[0].content
    # the worked episode writes its call out as text: a prompt message's tool_calls field
    # renders as nothing in the chat template
    call = '{"name": "calculate", "arguments": {"expression": "17 + 25"}}'
    assert messages[2].content == f"<tool_call>\n{call}\n</tool_call>"
    assert messages[3].content == "42" and messages[4].content == "<answer>42</answer>"
    assert '"23 * 14"' in messages[6].content and messages[8].content == "<answer>322</answer>"
    assert messages[-1].content.startswith(TASK.data["question"])
    assert env.tool_call_format == "hermes" and env.tools.names == ["calculate"]


async def test_without_demonstration_only_system_prompt_and_question() -> None:
    env = make("calculator", demonstration=False, instruction="")
    messages, _ = await env.reset(seed=0, options={"task": TASK})
    assert [m.role for m in messages] == ["system", "user"]
    assert messages[1].content == TASK.data["question"]


async def test_instruction_follows_each_question() -> None:
    env, messages = await new_episode()
    assert messages[1].content.endswith(CALL_FIRST) and messages[-1].content.endswith(CALL_FIRST)


async def test_tool_call_turn_returns_the_result_and_continues() -> None:
    env, _ = await new_episode()
    action = Message(
        role="assistant",
        tool_calls=[
            ToolCall("calculate", '{"expression": "17 + 25"}', "c1"),
            ToolCall("calculate", '{"expr": "1"}', "c2"),
        ],
    )
    result = await env.step(action)
    assert not result.terminated and not result.truncated and result.reward == 0.0
    assert [m.content for m in result.observation][0] == "42"
    assert result.observation[1].content.startswith("Error: invalid arguments")
    assert result.info == {"num_tool_calls": 2, "num_tool_errors": 1}


@pytest.mark.parametrize(
    ("content", "reward", "has_tag"),
    [
        ("17 + 25 = 42. <answer>42</answer>", 1.0, True),
        ("<answer> 42.0 </answer>", 1.0, True),
        ("<answer>41</answer> wait, <answer>42</answer>", 1.0, True),  # the last tag wins
        ("<answer>42</answer> no, <answer>43</answer>", 0.0, True),
        ("<answer>42 apples</answer>", 1.0, True),
        ("He has 42 apples.", 1.0, False),  # lenient: the last number of the message
        ("42 is wrong, it is 41", 0.0, False),
        ("I do not know.", 0.0, False),
    ],
)
async def test_final_answer_is_scored_and_ends_the_episode(
    content: str, reward: float, has_tag: bool
) -> None:
    env, _ = await new_episode()
    result = await env.step(Message(role="assistant", content=content))
    assert result.terminated and not result.truncated
    assert result.reward == reward
    assert result.info["correct"] is (reward == 1.0)
    assert result.info["has_answer_tag"] is has_tag
    assert result.info["num_tool_calls"] == 0


def test_parse_answer_thousands_separator() -> None:
    assert parse_answer("<answer>1,234</answer>") == (1234.0, True)


async def test_reset_without_task_generates_one_from_the_seed() -> None:
    env = make("calculator")
    first, _ = await env.reset(seed=5)
    again, _ = await env.reset(seed=5)
    other, _ = await env.reset(seed=6)
    assert first[-1].content == again[-1].content != other[-1].content


def test_splits_are_deterministic_sized_and_disjoint() -> None:
    train, test = CalculatorEnv.load_tasks("train"), CalculatorEnv.load_tasks("test")
    assert (len(train), len(test)) == (2000, 200)
    assert [t.to_dict() for t in CalculatorEnv.load_tasks("test")] == [t.to_dict() for t in test]
    train_questions = {t.data["question"] for t in train}
    assert len(train_questions) == 2000
    assert not train_questions & {t.data["question"] for t in test}
    assert len({t.id for t in train}) == 2000 and train[0].id == "calculator-train-0"
    assert {t.split for t in test} == {"test"}
    assert len(CalculatorEnv.load_tasks("train", num_tasks=10)) == 10


@pytest.mark.parametrize(("difficulty", "largest"), [(1, 50), (2, 500)])
def test_problems_answers_match_the_text(difficulty: int, largest: int) -> None:
    for task in CalculatorEnv.load_tasks("test", difficulty=difficulty):
        a, b = (int(n) for n in re.findall(r"\d+", task.data["question"]))
        assert max(a, b) <= largest
        assert task.data["answer"] in (a + b, abs(a - b), a * b)


def test_default_difficulty_is_beyond_mental_arithmetic() -> None:
    tasks = CalculatorEnv.load_tasks("test")
    assert tasks == CalculatorEnv.load_tasks("test", difficulty=2)
    assert sum(t.data["answer"] > 100 for t in tasks) > len(tasks) // 2


def test_load_tasks_takes_the_envs_other_kwargs() -> None:
    """data.load_tasks passes every env kwarg; prompt and reward settings leave tasks alone."""
    plain = CalculatorEnv.load_tasks("test", num_tasks=5)
    assert CalculatorEnv.load_tasks("test", num_tasks=5, format_weight=0.0) == plain


def test_difficulty_gives_bigger_numbers() -> None:
    hard = CalculatorEnv.load_tasks("test", difficulty=3)
    assert max(max(int(n) for n in re.findall(r"\d+", t.data["question"])) for t in hard) > 50


def test_task_from_row() -> None:
    task = CalculatorEnv.task_from_row({"question": "2 + 2?", "answer": "4", "id": "q7"}, index=0)
    assert (task.id, task.data) == ("q7", {"question": "2 + 2?", "answer": 4})
    task = CalculatorEnv.task_from_row(
        {"q": "1,000 + 1?", "a": "1,001"}, index=3, input_key="q", label_key="a"
    )
    assert (task.id, task.data["answer"]) == ("row-3", 1001)
    with pytest.raises(ValueError, match=r"row 5: missing field 'answer'"):
        CalculatorEnv.task_from_row({"question": "x"}, index=5)
    with pytest.raises(ValueError, match=r"row 6: answer 'many' is not a number"):
        CalculatorEnv.task_from_row({"question": "x", "answer": "many"}, index=6)
    # a NaN or inf label could never be matched; a null question became the text "None"
    with pytest.raises(ValueError, match=r"row 7: answer nan is not a finite number"):
        CalculatorEnv.task_from_row({"question": "x", "answer": float("nan")}, index=7)
    with pytest.raises(ValueError, match=r"row 8: answer inf is not a finite number"):
        CalculatorEnv.task_from_row({"question": "x", "answer": float("inf")}, index=8)
    with pytest.raises(ValueError, match=r"row 9: field 'question' is None; the question must"):
        CalculatorEnv.task_from_row({"question": None, "answer": 2}, index=9)
