"""What crosses between `LocalEngine`'s asyncio callers and its worker thread: commands run between
steps, results delivered back to the caller's loop, and the checks a request passes before it is
queued."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentrl.engine.base import SamplingParams


@dataclass
class Command:
    """Work run on the worker thread between decode steps (weight updates, abort, memory moves)."""

    fn: Callable[[], Any]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


def resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], result: Any) -> None:
    def set_once() -> None:
        if future.done():
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    try:
        loop.call_soon_threadsafe(set_once)
    except RuntimeError:  # the awaiting event loop has closed; nobody is waiting any more
        pass


def check_request(input_ids: list[int], sampling: SamplingParams, vocab_size: int) -> None:
    """A request's ids and sampling parameters, checked before it is queued (one-line errors)."""
    if not input_ids:
        raise ValueError("input_ids is empty; pass at least one prompt token")
    bad = [i for i in input_ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"input_ids hold {bad[:5]} outside the vocabulary [0, {vocab_size})")
    if sampling.temperature < 0:
        raise ValueError(f"sampling.temperature={sampling.temperature} must be >= 0 (0 = greedy)")
    if not 0 < sampling.top_p <= 1:
        raise ValueError(f"sampling.top_p={sampling.top_p} must be in (0, 1]")
    if sampling.top_k == 0 or sampling.top_k < -1:
        raise ValueError(f"sampling.top_k={sampling.top_k} must be -1 (off) or >= 1")
    if sampling.max_new_tokens < 0:
        raise ValueError(f"sampling.max_new_tokens={sampling.max_new_tokens} must be >= 0")
