"""Tool return values as text, and long text cut to a budget keeping its head and tail."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

CHARS_PER_TOKEN = 4
"""Character budget per token when no tokenizer is bound (a common English average)."""
_MARKER_TOKENS = 16
"""Room left in the budget for the truncation marker itself."""


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
    elif hasattr(value, "model_dump"):
        value = value.model_dump(mode="json")
    return json.dumps(value, ensure_ascii=False, default=str)


def truncate(text: str, max_tokens: int | None, tokenizer: Any = None) -> str:
    """Cut `text` to about `max_tokens` tokens: head, a marker saying how much went, tail.

    Counts real tokens with a HF tokenizer; else characters (CHARS_PER_TOKEN per token).
    """
    if max_tokens is None or max_tokens <= 0:
        return text
    if tokenizer is not None:
        return _truncate_tokens(text, max_tokens, tokenizer)
    return _truncate_chars(text, max_tokens * CHARS_PER_TOKEN)


def _split(budget: int) -> tuple[int, int]:
    keep = max(budget - _MARKER_TOKENS, 2)
    head = (keep + 1) // 2
    return head, keep - head


def _truncate_tokens(text: str, max_tokens: int, tokenizer: Any) -> str:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text
    num_head, num_tail = _split(max_tokens)
    num_cut = len(ids) - num_head - num_tail
    head = tokenizer.decode(ids[:num_head])
    tail = tokenizer.decode(ids[len(ids) - num_tail :]) if num_tail else ""
    return f"{head}\n[... {num_cut} tokens truncated ...]\n{tail}"


def _truncate_chars(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    num_head, num_tail = _split(max_chars // CHARS_PER_TOKEN)
    num_head, num_tail = num_head * CHARS_PER_TOKEN, num_tail * CHARS_PER_TOKEN
    num_cut = len(text) - num_head - num_tail
    tail = text[len(text) - num_tail :] if num_tail else ""
    return f"{text[:num_head]}\n[... {num_cut} characters truncated ...]\n{tail}"
