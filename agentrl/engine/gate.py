"""`GatedEngine`: the engine as episodes see it, with a gate a weight update closes. Closing it
lets the turns being generated finish on the weights that started them and holds the next turns
until the update is done, so no episode is aborted and every turn has one policy version. It
also keeps the time the engine had work (for the idle fraction)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from agentrl.engine.base import Completion, Engine, SamplingParams


class GatedEngine:
    """Delegates everything to `engine`; `generate` waits while a weight update holds the gate.
    `clock` times the busy seconds (a test passes its own)."""

    def __init__(self, engine: Engine, clock: Callable[[], float] = time.perf_counter) -> None:
        self.inner = engine
        self._clock = clock
        # asyncio (3.10+) binds an Event to a loop at its first wait, not at its creation
        self._is_open = asyncio.Event()
        self._idle = asyncio.Event()
        self._is_open.set()
        self._idle.set()
        self.num_running = 0  # generate calls inside the engine now
        self.num_turns_held = 0  # over the run: turns that waited for a weight update
        self._busy_s = 0.0
        self._busy_since: float | None = None
        self._num_pauses = 0  # nested pauses: the gate opens when the last one ends

    def __getattr__(self, name: str) -> Any:  # tokenizer, weight_version, clients, ...
        return getattr(self.inner, name)

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, routing_key: str | None = None
    ) -> Completion:
        if not self._is_open.is_set():
            self.num_turns_held += 1
            await self._is_open.wait()
        self._enter()
        try:
            return await self.inner.generate(input_ids, sampling, routing_key=routing_key)
        finally:
            self._leave()

    def _enter(self) -> None:
        if self.num_running == 0:
            self._busy_since = self._clock()
        self.num_running += 1
        self._idle.clear()

    def _leave(self) -> None:
        self.num_running -= 1
        if self.num_running == 0:
            if self._busy_since is not None:
                self._busy_s += self._clock() - self._busy_since
            self._busy_since = None
            self._idle.set()

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """Close the gate, wait for the running turns to finish, run the body (the weight
        update), open the gate: held turns then generate on the new weights."""
        self._num_pauses += 1
        self._is_open.clear()
        try:
            await self._idle.wait()
            yield
        finally:
            self._num_pauses -= 1
            if self._num_pauses == 0:
                self._is_open.set()

    def busy_seconds(self) -> float:
        """Total time with at least one generation running, up to now."""
        running = self._clock() - self._busy_since if self._busy_since is not None else 0.0
        return self._busy_s + running
