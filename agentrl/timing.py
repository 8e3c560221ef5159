"""`timed`: the seconds a block takes, added to a metrics dict under its `time/..._s` name."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def timed(
    into: dict[str, float], key: str, *, clock: Callable[[], float] = time.perf_counter
) -> Iterator[None]:
    """Add the block's wall time to `into[key]` (a key timed twice sums), also when it raises."""
    start = clock()
    try:
        yield
    finally:
        into[key] = into.get(key, 0.0) + clock() - start
