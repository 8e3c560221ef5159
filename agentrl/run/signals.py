"""Ctrl-C and SIGTERM (a scheduler's preemption) stop a run alike: the run's task is cancelled,
a weight update under way finishes, the last completed step is saved."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator

from agentrl.progress import RunProgress


@contextlib.contextmanager
def stop_on_signals(progress: RunProgress) -> Iterator[None]:
    """Ctrl-C and SIGTERM (a scheduler's preemption) stop the run alike: say so at once, cancel
    the run (a weight update under way finishes first, see `RunState.learn`), save the last
    completed step, stop every worker. A second signal only says the save is still going."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    if task is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}
    is_stopping = False

    def stop(name: str) -> None:
        nonlocal is_stopping
        if is_stopping:
            progress.note(f"{name} again: still saving the checkpoint, please wait")
            return
        is_stopping = True
        # The step under way is not finished: its rollout is dropped (its tasks are drawn again
        # on resume); only a weight update under way ends first, and its step counts.
        progress.note(f"{name}: stopping; a rollout under way is dropped, an update finishes…")
        task.cancel()

    for signum, name in signals.items():
        loop.add_signal_handler(signum, stop, name)
    try:
        yield
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)
