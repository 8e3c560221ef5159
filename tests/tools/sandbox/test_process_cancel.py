"""A run cancelled while its child is still starting (a SIGTERM to `agentrl sandbox run`, an
episode cancelled on Ctrl-C) ends at once. asyncio 3.11, cancelled there, kills the child and
then waits for its pipes to close — forever when a grandchild already holds them, as bwrap's
inner process does when the outer one is killed that early."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest

from agentrl.tools.sandbox.base import Limits
from agentrl.tools.sandbox.process import run_process

from .conftest import processes_with


def _fork_a_holder(marker: str):
    """preexec_fn: before the child execs, fork a grandchild in its own session that keeps the
    child's stdout and stderr open (what a fast-starting bwrap leaves when killed)."""

    def preexec() -> None:
        if os.fork() == 0:
            os.setsid()
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", marker])

    return preexec


async def test_a_run_cancelled_while_its_child_starts_ends_at_once() -> None:
    marker = f"agentrl-cancel-test-{os.getpid()}"
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    run = asyncio.ensure_future(
        run_process(argv, stdin=b"", limits=Limits(timeout_s=60), preexec_fn=_fork_a_holder(marker))
    )
    await asyncio.sleep(0)  # the run is inside the start: the child and its holder exist
    run.cancel()
    try:
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(run), timeout=20)  # hung before the fix
    finally:
        for pid in processes_with(marker):  # the holder escaped the group kill: ours to end
            os.kill(pid, signal.SIGKILL)
