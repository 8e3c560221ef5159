"""A global cap on concurrent sandbox runs, separate from how many episodes run at once.

Episodes think and wait on the engine most of the time; sandboxes burn CPU and memory. So
`max_concurrent_episodes` may be 256 while only a few programs run at any moment. A lease is
released when its `async with` block exits for any reason (error, cancel, Ctrl-C).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class Leases:
    """`max_concurrency` numbered slots; works across event loops and threads."""

    def __init__(self, max_concurrency: int) -> None:
        if max_concurrency < 1:
            raise ValueError(f"sandbox max_concurrency={max_concurrency} must be >= 1")
        self.max_concurrency = max_concurrency
        self._lock = threading.Lock()
        self._free = list(range(max_concurrency - 1, -1, -1))
        self._waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future[int]]] = deque()

    @property
    def in_use(self) -> int:
        with self._lock:
            return self.max_concurrency - len(self._free)

    @asynccontextmanager
    async def lease(self) -> AsyncIterator[int]:
        """Hold one slot (its number is yielded) for the duration of the block."""
        slot = await self._acquire()
        try:
            yield slot
        finally:
            self._release(slot)

    async def _acquire(self) -> int:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._free and not self._waiters:
                return self._free.pop()
            waiter = (loop, loop.create_future())
            self._waiters.append(waiter)
        try:
            return await waiter[1]
        except asyncio.CancelledError:
            with self._lock:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                    raise
            fut = waiter[1]
            if fut.done() and not fut.cancelled():  # a slot reached us just as we were cancelled
                self._release(fut.result())
            raise

    def _release(self, slot: int) -> None:
        with self._lock:
            while self._waiters:
                loop, fut = self._waiters.popleft()
                if not fut.done() and not loop.is_closed():
                    loop.call_soon_threadsafe(self._hand_over, fut, slot)
                    return
            self._free.append(slot)

    def _hand_over(self, fut: asyncio.Future[int], slot: int) -> None:
        if fut.done():  # cancelled while the slot was on its way: pass it on
            self._release(slot)
        else:
            fut.set_result(slot)


_default: Leases | None = None
_default_lock = threading.Lock()


def default_leases() -> Leases:
    """The process-wide leases every sandbox shares unless given its own. Size:
    $AGENTRL_SANDBOX_CONCURRENCY, else the number of CPUs."""
    global _default
    with _default_lock:
        if _default is None:
            size = int(os.environ.get("AGENTRL_SANDBOX_CONCURRENCY") or os.cpu_count() or 1)
            _default = Leases(size)
        return _default
