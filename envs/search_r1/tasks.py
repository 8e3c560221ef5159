"""Tasks for search_r1: the embedded splits and user rows in Search-R1/verl or FlashRAG shape."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

from agentrl_envs.search_r1.protocol import PROMPT_TEMPLATE

from agentrl.types import Task

_PROMPT_PREFIX = PROMPT_TEMPLATE.split("{question}")[0]


def task_from_row(
    row: dict[str, Any],
    *,
    index: int,
    input_key: str | None = None,
    label_key: str | None = None,
    split: str | None = None,
) -> Task:
    """Accepts `question` or `prompt` (a chat list or a string; a Search-R1 prompt gives back
    its question) and `golden_answers` or `reward_model.ground_truth.target`. The task keeps
    the row's own id: `id` (FlashRAG, the shipped splits), else `data_source`, `extra_info.split`
    and `extra_info.index` (Search-R1's parquet), else the row's place in its file."""
    question, prompt = _read_question(row, index, input_key)
    answers = _read_answers(row, index, label_key)
    data: dict[str, Any] = {"question": question, "golden_answers": answers}
    if prompt is not None:
        data["prompt"] = prompt  # not in Search-R1's shape: used verbatim as the user message
    for key in ("data_source", "titles", "hops"):  # where a row came from, kept for analysis
        if key in row:
            data[key] = row[key]
    return Task(id=_row_id(row, index, split), data=data, split=split or "train")


def _row_id(row: dict[str, Any], index: int, split: str | None) -> str:
    if isinstance(row.get("id"), (str, numbers.Integral)) and str(row["id"]).strip():
        return str(row["id"])
    extra = row.get("extra_info")
    if isinstance(extra, dict) and isinstance(extra.get("index"), numbers.Integral):
        parts = [row.get("data_source"), extra.get("split"), str(extra["index"])]
        return "-".join(str(p) for p in parts if p)
    return f"{split or 'row'}-{index}"


def _read_question(
    row: dict[str, Any], index: int, input_key: str | None
) -> tuple[str, str | None]:
    keys = [input_key] if input_key else ["question", "prompt"]
    key = next((k for k in keys if row.get(k) is not None), None)
    if key is None:
        raise ValueError(
            f"row {index}: missing field {' or '.join(repr(k) for k in keys)} (the question); "
            f"row has {sorted(row)}; pass input_key=... to name the column"
        )
    value = row[key]
    if not isinstance(value, str):
        value = _last_user_content(value, index, key)
    if _PROMPT_PREFIX.strip() and value.startswith(_PROMPT_PREFIX):
        return value[len(_PROMPT_PREFIX) :].strip(), None
    return (value.strip(), None) if key == "question" or input_key else (value.strip(), value)


def _last_user_content(messages: Any, index: int, key: str) -> str:
    try:
        contents = [m["content"] for m in list(messages) if m.get("role", "user") == "user"]
    except (TypeError, KeyError, AttributeError):
        contents = []
    if not contents or not isinstance(contents[-1], str):
        raise ValueError(
            f"row {index}: field {key!r} must be a string or a list of chat messages with a user turn, got {str(messages)[:100]}"
        )
    return contents[-1]


def _read_answers(row: dict[str, Any], index: int, label_key: str | None) -> list[str]:
    if label_key:
        value = row.get(label_key)
        missing = f"{label_key!r}"
    else:
        value = row.get("golden_answers")
        if value is None:
            value = _dig(row, ("reward_model", "ground_truth", "target"))
        missing = "'golden_answers' or 'reward_model.ground_truth.target'"
    if value is None:
        raise ValueError(
            f"row {index}: missing field {missing} (the gold answers); row has {sorted(row)}; "
            "pass label_key=... to name the column"
        )
    if not isinstance(value, str) and not hasattr(value, "__iter__"):
        raise ValueError(
            f"row {index}: field {missing} is {value!r}; give a string or a list of gold answers"
        )
    answers = (
        [value]
        if isinstance(value, str)
        else [_answer_text(v, index, missing) for v in _as_list(value)]
    )
    if not answers:
        raise ValueError(f"row {index}: field {missing} is empty; give at least one gold answer")
    return answers


def _answer_text(value: Any, index: int, field: str) -> str:
    """A gold answer as text: a string, or a finite number (a year, a count); None and NaN are
    refused, or they would be scored as the words "None" and "nan"."""
    is_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if isinstance(value, str) and value.strip():
        return value
    if is_number and math.isfinite(value):
        return str(value)
    raise ValueError(
        f"row {index}: a gold answer in {field} is {value!r}; each must be non-empty text or a finite number"
    )


def _dig(row: dict[str, Any], path: Sequence[str]) -> Any:
    value: Any = row
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def _as_list(value: Any) -> list[Any]:
    return value.tolist() if hasattr(value, "tolist") else list(value)
