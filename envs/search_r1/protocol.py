"""The Search-R1 text protocol: the prompt, the action tags, the observation and the hint.

Matches PeterGriffinJin/Search-R1 (`scripts/data_process/nq_search.py`,
`search_r1/llm_agent/generation.py`) character for character.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

# Verbatim from nq_search.py `make_prefix(template_type="base")`, typo "as your want" included.
PROMPT_TEMPLATE = (
    "Answer the given question. "
    "You must conduct reasoning inside <think> and </think> first every time you get new information. "
    "After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query </search> "
    "and it will return the top searched results between <information> and </information>. "
    "You can search as many times as your want. "
    "If you find no further external knowledge needed, you can directly provide the answer inside <answer> and </answer>, "
    "without detailed illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)

# Verbatim from generation.py `execute_predictions` (the invalid-action branch).
INVALID_ACTION_HINT = (
    "\nMy previous action is invalid. "
    "If I want to search, I should put the query between <search> and </search>. "
    "If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)

STOP = ("</search>", "</answer>")

_ACTION_RE = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


def normalize_question(question: str) -> str:
    """Strip and end with '?', as nq_search.py does before filling the prompt."""
    question = question.strip()
    if question and not question.endswith("?"):
        question += "?"
    return question


def make_prompt(question: str, template: str = PROMPT_TEMPLATE) -> str:
    return template.format(question=normalize_question(question))


@dataclass(frozen=True)
class Action:
    """What one assistant turn asked for: `search` (content = query), `answer`, or None (invalid)."""

    kind: Literal["search", "answer"] | None
    content: str = ""


def parse_action(text: str) -> Action:
    """The first `<search>..</search>` or `<answer>..</answer>` block, as Search-R1's
    `postprocess_predictions` does after cutting the turn at the first stop string."""
    text = cut_at_stop(text)
    match = _ACTION_RE.search(text)
    if match is None:
        return Action(None)
    return Action(match.group(1), match.group(2).strip())  # type: ignore[arg-type]


def cut_at_stop(text: str) -> str:
    """Search-R1 cut decoded turns at `</search>` first, else `</answer>`; the engine's stop
    strings normally make this a no-op (it matters for engines that overrun a stop)."""
    for stop in STOP:
        if stop in text:
            return text.split(stop)[0] + stop
    return text


def format_documents(contents: list[str]) -> str:
    """`Doc {i}(Title: {title}) {text}` per document; the title keeps the corpus's quotes,
    exactly as `_passages2string` splits `contents` on its first newline."""
    out = ""
    for i, content in enumerate(contents):
        lines = content.split("\n")
        out += f"Doc {i + 1}(Title: {lines[0]}) {chr(10).join(lines[1:])}\n"
    return out


def format_observation(documents_text: str) -> str:
    return f"\n\n<information>{documents_text.strip()}</information>\n\n"


# One worked episode (search, documents, answer) shown before the question when the env is made
# with `demonstration=True`: a 135M instruct model given the paper's prompt alone wrote
# `<answer>` in 0 of 32 first turns; after this example, in 9 of 32 (temperature 0.7), which is
# what gives GRPO groups a reward spread to learn from.
DEMONSTRATION_QUESTION = (
    'What is the subject of this description: "___ is the capital and largest city of France."'
)
DEMONSTRATION_TURNS: tuple[tuple[str, str], ...] = (
    (
        "assistant",
        "<think> I need to find the capital of France. </think>\n<search> capital of France </search>",
    ),
    (
        "tool",
        format_observation(
            'Doc 1(Title: "Paris") Paris is the capital and largest city of France.\n'
            'Doc 2(Title: "France") France is a country in Western Europe.\n'
        ),
    ),
    ("assistant", "<think> The documents say Paris. </think>\n<answer> Paris </answer>"),
)
