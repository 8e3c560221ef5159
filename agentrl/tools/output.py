"""Tool return values as text, and `truncate_middle`: long text cut to a token budget keeping
its head and tail (the one such helper; observations and documents use it too)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Protocol

import pydantic

CHARS_PER_TOKEN = 4
"""Character budget per token when no tokenizer is given (a common English average)."""


class TextTokenizer(Protocol):
    """Plain text to ids and back, no special tokens added: what `ChatCodec` offers."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def format_output(value: Any) -> str:
    """str as is; anything else as JSON (dataclasses and pydantic models included)."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="replace")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    elif isinstance(value, pydantic.BaseModel):
        value = value.model_dump(mode="json")
    return json.dumps(value, ensure_ascii=False, default=str)


def truncate_middle(
    text: str, max_tokens: int | None, tokenizer: TextTokenizer | None = None
) -> str:
    """`text` in at most about `max_tokens` tokens: its head, a marker saying how much went,
    its tail. The marker counts against the budget; None or <= 0 means no limit.

    Counts real tokens with `tokenizer`; without one, characters (CHARS_PER_TOKEN per token).
    """
    if max_tokens is None or max_tokens <= 0:
        return text
    units: Any  # the text's characters or its token ids
    if tokenizer is None:
        units = text
        budget = max_tokens * CHARS_PER_TOKEN
        what = "characters"
    else:
        units = tokenizer.encode(text)
        budget = max_tokens
        what = "tokens"
    if len(units) <= budget:
        return text
    widest = _marker(len(units), what)  # as many digits as the real marker can have
    keep = max(budget - (len(widest) if tokenizer is None else len(tokenizer.encode(widest))), 2)
    head = units[: (keep + 1) // 2]
    tail = units[len(units) - keep // 2 :]
    if tokenizer is not None:
        head, tail = tokenizer.decode(head), tokenizer.decode(tail)
    return f"{head}{_marker(len(units) - keep, what)}{tail}"


def _marker(num_cut: int, what: str) -> str:
    return f"\n[... {num_cut} {what} truncated ...]\n"
