"""The built-in `calculator` env: seeded arithmetic word problems, a safe `calculate` tool
(`calculator_tool.py`), a reward of 1.0 for the exact answer and 0.1 for a wrong tagged answer
read off a tool result. Its defaults are a recipe under which the bundled 135M model calls
the tool (benchmarks/calculator_cpu/, benchmarks/gpu/calculator/)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from agentrl.envs.base import AgentEnv, StepResult, tool_info
from agentrl.envs.builtin.calculator_tool import calculate, evaluate, format_number
from agentrl.types import Message, Task, ToolCall

SYSTEM_PROMPT = (
    "You solve arithmetic word problems. You may use the calculate tool to evaluate an "
    "arithmetic expression, like this:\n"
    '<tool_call>\n{"name": "calculate", "arguments": {"expression": "17 + 25"}}\n</tool_call>\n'
    "Give the final answer as <answer>NUMBER</answer>, for example <answer>42</answer>."
)

# Worked episodes shown before the question (`demonstration=True`): a tool call, its result, the
# tagged answer, once adding and once multiplying. The 135M model copies the last assistant turn
# it saw: after one worked episode (ending in `<answer>`) its greedy first turn answered at once
# in 16 of 16 held-out problems; after two (a call follows a question twice) it called the
# tool in 15 of 16 (benchmarks/calculator_cpu/).
DEMONSTRATIONS = (
    ("Lena has 17 shells and finds 25 more. How many shells does Lena have?", "17 + 25"),
    ("There are 23 boxes and each box holds 14 pens. How many pens are there in total?", "23 * 14"),
)
CALL_FIRST = (
    "\nFirst call calculate with the arithmetic expression, then give <answer>NUMBER</answer>."
)
"""Appended to each question (`instruction=`)."""

FORMAT_WEIGHT = 0.1
"""Paid for a wrong `<answer>` given after a tool result (`format_weight=`): calling and
reading the result beats guessing, and never outweighs a right answer (1.0)."""

NUM_TASKS = {"train": 2000, "test": 200, "dev": 200}
MAX_TEST_TASKS = 1000
"""Test problems reserved: train and dev never contain the first MAX_TEST_TASKS of them."""
_SPLIT_SEEDS = {"train": 1, "test": 2, "dev": 3}

# ---------------------------------------------------------------- the problems


_NAMES = (
    "Tom",
    "Anna",
    "Ben",
    "Maria",
    "Sam",
    "Lena",
    "Omar",
    "Yuki",
    "Ravi",
    "Chloe",
    "Max",
    "Nora",
)
_ITEMS = (
    "apples",
    "marbles",
    "stickers",
    "books",
    "coins",
    "pencils",
    "cookies",
    "stamps",
    "shells",
    "cards",
)
_TEMPLATES: dict[str, tuple[str, ...]] = {
    "+": (
        "{name} has {a} {item} and buys {b} more. How many {item} does {name} have?",
        "{name} has {a} {item}. A friend gives {name} {b} more. How many {item} does {name} have now?",
        "There are {a} {item} in a box and {b} {item} on the table. How many {item} are there in total?",
    ),
    "-": (
        "{name} has {a} {item} and gives {b} of them away. How many {item} does {name} have left?",
        "A shop has {a} {item} and sells {b}. How many {item} are left in the shop?",
        "{name} had {a} {item} and lost {b}. How many {item} does {name} have now?",
    ),
    "*": (
        "{name} buys {a} bags with {b} {item} in each bag. How many {item} does {name} have?",
        "There are {a} boxes and each box holds {b} {item}. How many {item} are there in total?",
        "{name} collects {b} {item} every day for {a} days. How many {item} does {name} collect?",
    ),
}


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int

    def task(self, task_id: str, split: str = "train") -> Task:
        return Task(task_id, {"question": self.question, "answer": self.answer}, split)


def generate_problem(rng: random.Random, difficulty: int = 1) -> Problem:
    """One word problem with one operation. difficulty 1: operands <= 50 (products of
    factors <= 12); each level up multiplies the operand range by 10."""
    check_difficulty(difficulty)
    op = rng.choice("+-*")
    scale = 10 ** (difficulty - 1)
    if op == "*":
        a = rng.randint(2, 12 * scale)
        b = rng.randint(2, 12 * scale)
    else:
        a = rng.randint(1, 50 * scale)
        b = rng.randint(1, 50 * scale)
        if op == "-" and b > a:
            a, b = b, a
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    template = rng.choice(_TEMPLATES[op])
    question = template.format(name=rng.choice(_NAMES), item=rng.choice(_ITEMS), a=a, b=b)
    return Problem(question, answer)


def check_difficulty(difficulty: Any) -> None:
    """`--set env.kwargs.difficulty=abc` arrives as text: refuse it by name, not with a
    comparison error from inside the generator."""
    if isinstance(difficulty, bool) or not isinstance(difficulty, int) or difficulty < 1:
        raise ValueError(
            f"env.kwargs.difficulty={difficulty!r}: use an int >= 1 (1: operands up to 50, "
            "2: up to 500, each level x10)"
        )


def generate_problems(
    num: int, *, seed: int, difficulty: int = 1, exclude: frozenset[str] = frozenset()
) -> list[Problem]:
    """`num` distinct problems, none of whose text is in `exclude`; same seed, same list."""
    rng = random.Random(seed)
    seen = set(exclude)
    problems: list[Problem] = []
    for _ in range(num * 100):
        if len(problems) == num:
            return problems
        p = generate_problem(rng, difficulty)
        if p.question not in seen:
            seen.add(p.question)
            problems.append(p)
    raise ValueError(f"could only generate {len(problems)} distinct problems of {num} requested")


# ---------------------------------------------------------------- answers and reward

# The tags alone, not `<answer>(.*?)</answer>`: that regex rescans to the end of the text from
# every unclosed `<answer>`, and a 125 KiB action of them took 13 s (1 MiB: ~14 min).
_ANSWER_TAG = re.compile(r"<(/?)answer>", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")


def last_number(text: str) -> float | None:
    matches = _NUMBER.findall(text)
    return float(matches[-1].replace(",", "")) if matches else None


def parse_answer(text: str) -> tuple[float | None, bool]:
    """(the predicted number, whether it came from an <answer> tag).

    The last `<answer>` block wins; without one we fall back (leniently) to the last number
    in the message, so an early policy that answers in prose still gets a learning signal.
    """
    block = last_answer_block(text)
    if block is not None:
        return last_number(block), True
    return last_number(text), False


def last_answer_block(text: str) -> str | None:
    """The text of the last `<answer>...</answer>` block (case-insensitive; an `<answer>` inside
    an open block is text, the first `</answer>` closes it), in one pass over the text."""
    last = None
    start = None
    for tag in _ANSWER_TAG.finditer(text):
        if tag.group(1) and start is not None:
            last, start = text[start : tag.start()], None
        elif not tag.group(1) and start is None:
            start = tag.end()
    return last


def parse_label(value: Any, *, where: str) -> int | float:
    """A gold answer from a data row: a number, or a string holding one ("1,234", "42.0")."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(
                f"{where}: answer {value!r} is not a finite number; fix or drop the row"
            )
        return value
    number = last_number(str(value)) if isinstance(value, str) else None
    if number is None:
        raise ValueError(f"{where}: answer {value!r} is not a number")
    return int(number) if number.is_integer() else number


# ---------------------------------------------------------------- the env


def demonstration(instruction: str = CALL_FIRST) -> list[Message]:
    """The worked episodes. Each call is written out in the message text, as the model writes
    its own: the chat template renders a prompt message's `tool_calls` field as nothing."""
    messages: list[Message] = []
    for i, (question, expression) in enumerate(DEMONSTRATIONS):
        call = json.dumps({"name": "calculate", "arguments": {"expression": expression}})
        result = format_number(evaluate(expression))
        messages += [
            Message(role="user", content=question + instruction),
            Message(role="assistant", content=f"<tool_call>\n{call}\n</tool_call>"),
            Message(role="tool", content=result, tool_call_id=f"demo-{i}", name="calculate"),
            Message(role="assistant", content=f"<answer>{result}</answer>"),
        ]
    return messages


_EXPRESSION_FIELD = re.compile(r'"expression"\s*:\s*"([^"]*)"')
# A run of arithmetic characters, taken whole: nothing follows the `*`, so it never backtracks
# (`...*[\d)]` did, from every `(` of a `((((` block: quadratic); `_arithmetic_in` trims the
# run to its last digit or `)`.
_ARITHMETIC_RUN = re.compile(r"[-(\d][\d\s.+\-*/×÷^%()]*")
_OPERATION = re.compile(r"[\d)]\s*(?:[-+*/×÷^%])")


def repair_call(call: ToolCall) -> ToolCall:
    """A near-miss `calculate` call read as the call it meant (`lenient_calls`): malformed JSON
    (`{"name": "calculate", ...}}`), another argument name (`{"value": "3 * 4"}`) or no name
    at all. The expression is the `"expression"` field if one is written, else the first
    arithmetic with an operation in the block. Well-formed calls, calls to another tool and
    blocks without arithmetic come back unchanged (the registry answers them as errors).
    Only the env's reading changes: the sampled tokens are what they were."""
    if call.name not in ("calculate", ""):
        return call
    try:
        args = json.loads(call.arguments)
    except (json.JSONDecodeError, TypeError):
        args = None
    if isinstance(args, dict) and isinstance(args.get("expression"), str):
        return call
    expression = _expression_in(str(call.arguments))
    if expression is None:
        return call
    arguments = json.dumps({"expression": expression})
    return ToolCall(name="calculate", arguments=arguments, id=call.id)


def _expression_in(text: str) -> str | None:
    field = _EXPRESSION_FIELD.search(text)
    candidates = [field.group(1)] if field else []
    candidates += _arithmetic_in(text)
    return next((c.strip() for c in candidates if _OPERATION.search(c)), None)


def _arithmetic_in(text: str) -> list[str]:
    """Each arithmetic stretch: a run from a digit, `-` or `(` to its last digit or `)`, two
    characters at least."""
    runs = (_up_to_last_ending(m.group(0)) for m in _ARITHMETIC_RUN.finditer(text))
    return [run for run in runs if len(run) >= 2]


def _up_to_last_ending(run: str) -> str:
    for end in range(len(run) - 1, -1, -1):
        if run[end].isdecimal() or run[end] == ")":  # `\d` is `isdecimal`
            return run[: end + 1]
    return ""


def score(
    predicted: float | None,
    gold: float,
    *,
    has_answer_tag: bool,
    after_tool_result: bool,
    format_weight: float = FORMAT_WEIGHT,
) -> float:
    """1.0 for the right number; else `format_weight` for a tagged answer given after a
    successful tool result (the call was made and read, the expression was wrong); else 0."""
    if predicted is not None and abs(predicted - gold) < 1e-6:
        return 1.0
    return format_weight if has_answer_tag and after_tool_result else 0.0


class CalculatorEnv(AgentEnv):
    """Arithmetic word problems with a `calculate` tool; reward 1.0 for the exact answer.

    Defaults are the recipe under which the bundled 135M model learns to call the tool:
    `difficulty=2` (three-digit sums and differences, products up to 120 x 120: answered in
    its head it scored 0 of 16, with the tool 6 of 16); `demonstration=True` shows two worked
    episodes that call the tool first; `instruction` (appended to each question) asks for
    the call ("" leaves the question bare); `lenient_calls` reads near-miss calls
    (`repair_call`); `format_weight` is paid for a wrong tagged answer that follows a tool
    result (`score`), 0 turns it off.

    An assistant message with tool calls gets the tool results back; one without tool
    calls is the final answer and ends the episode (terminated). The answer is the number
    in the last `<answer>` block or, leniently, the last number in that message;
    `info["correct"]`, `info["has_answer_tag"]` and `info["reward_components"]` hold the
    reward's parts.
    """

    reward_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    tool_call_format: ClassVar[str] = "hermes"  # type: ignore[misc]
    metadata: ClassVar[dict[str, Any]] = {"description": "arithmetic word problems"}

    def __init__(
        self,
        difficulty: int = 2,
        demonstration: bool = True,
        instruction: str = CALL_FIRST,
        lenient_calls: bool = True,
        format_weight: float = FORMAT_WEIGHT,
    ) -> None:
        super().__init__()
        if not 0.0 <= format_weight < 1.0:
            raise ValueError(
                f"format_weight={format_weight}: use a value in [0, 1), below a right answer's 1.0"
            )
        check_difficulty(difficulty)
        self.difficulty = difficulty
        self.use_demonstration = demonstration
        self.instruction = instruction
        self.lenient_calls = lenient_calls
        self.format_weight = format_weight
        self.tools.register(calculate)
        self.question = ""
        self.answer: int | float = 0
        self.num_tool_results = 0  # successful results this episode

    async def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        task = (options or {}).get("task")
        if task is None:  # no dataset row: make one from the seed
            task = generate_problem(random.Random(seed), self.difficulty).task(
                f"calculator-seed-{seed}"
            )
        self.question = task.data["question"]
        self.answer = parse_label(task.data["answer"], where=f"task {task.id}")
        self.num_tool_results = 0
        messages = [
            Message(role="system", content=SYSTEM_PROMPT),
            *(demonstration(self.instruction) if self.use_demonstration else []),
            Message(role="user", content=self.question + self.instruction),
        ]
        return messages, {"task_id": task.id}

    async def step(self, action: Message) -> StepResult:
        if action.tool_calls:
            if self.lenient_calls:
                action = dataclasses.replace(
                    action, tool_calls=[repair_call(c) for c in action.tool_calls]
                )
            results = await self.call_tools(action)
            self.num_tool_results += sum(not r.is_error for r in results)
            return StepResult(observation=[r.message for r in results], info=tool_info(results))
        predicted, has_answer_tag = parse_answer(action.content)
        after_tool = self.num_tool_results > 0
        reward = score(
            predicted,
            self.answer,
            has_answer_tag=has_answer_tag,
            after_tool_result=after_tool,
            format_weight=self.format_weight,
        )
        is_correct = reward == 1.0
        info = {
            "correct": is_correct,
            "has_answer_tag": has_answer_tag,
            "predicted": predicted,
            "answer": self.answer,
            "reward_components": {
                "correct": is_correct,
                "used_tool": after_tool,
                "answer_after_tool": has_answer_tag and after_tool,
            },
            **tool_info([]),
        }
        return StepResult(reward=reward, terminated=True, info=info)

    @classmethod
    def load_tasks(
        cls,
        split: str,
        *,
        num_tasks: int | None = None,
        difficulty: int = 2,
        seed: int = 0,
        **env_kwargs: Any,
    ) -> list[Task]:
        """Generated splits: "train" (2000), "test" (200), "dev" (200); disjoint by problem text.
        The env's other kwargs (`env_kwargs`: prompt and reward settings) do not change tasks."""
        check_difficulty(difficulty)
        if split not in _SPLIT_SEEDS:
            raise ValueError(f"calculator has splits {sorted(_SPLIT_SEEDS)}, not {split!r}")
        num = num_tasks or NUM_TASKS[split]
        if split == "test" and num > MAX_TEST_TASKS:
            raise ValueError(f"calculator test split: num_tasks={num}, at most {MAX_TEST_TASKS}")
        # Held-out problems come first; train and dev skip them (a prefix of the same stream).
        reserved = generate_problems(
            MAX_TEST_TASKS, seed=seed * 10 + _SPLIT_SEEDS["test"], difficulty=difficulty
        )
        if split == "test":
            problems = reserved[:num]
        else:
            exclude = frozenset(p.question for p in reserved)
            problems = generate_problems(
                num, seed=seed * 10 + _SPLIT_SEEDS[split], difficulty=difficulty, exclude=exclude
            )
        return [p.task(f"calculator-{split}-{i}", split) for i, p in enumerate(problems)]

    @classmethod
    def task_from_row(
        cls,
        row: dict[str, Any],
        *,
        index: int,
        input_key: str | None = None,
        label_key: str | None = None,
    ) -> Task:
        input_key, label_key = input_key or "question", label_key or "answer"
        for key in (input_key, label_key):
            if key not in row:
                raise ValueError(
                    f"row {index}: missing field {key!r} (fields: {sorted(row)}); set input_key/label_key"
                )
        question = row[input_key]
        if not isinstance(question, str) or not question.strip():
            raise ValueError(
                f"row {index}: field {input_key!r} is {question!r}; the question must be non-empty text"
            )
        answer = parse_label(row[label_key], where=f"row {index}")
        task_id = str(row.get("id", f"row-{index}"))
        return Task(id=task_id, data={"question": question, "answer": answer})
