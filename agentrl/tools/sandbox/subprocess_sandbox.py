"""Unsafe backend: a plain child process under rlimits, a wall clock and a cleared environment.
It isolates nothing (files, network and other processes are all reachable; run as root it at
least drops to an unused uid per slot), so it refuses to exist unless asked for with `allow_unsafe=True`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import threading

from agentrl.tools.sandbox.base import Limits, Program
from agentrl.tools.sandbox.leases import Leases, default_leases
from agentrl.tools.sandbox.process import ENV, RawRun, make_preexec, rlimits, run_process
from agentrl.tools.sandbox.workdir import HostSandbox, WorkDir, reap_stale

MAX_RUNS_PER_PROCESS = 1000


class _RunUids:
    """Run as root, each concurrent run gets an unused uid of its own: RLIMIT_NPROC counts per
    uid (a shared `nobody` would count other sandboxes' and containers' processes too), and
    after the run `kill -9 -1` as that uid sweeps every process it left, daemons included.
    The range depends on our pid so that two agentrl processes do not share uids."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free = list(range(MAX_RUNS_PER_PROCESS))

    def take(self) -> int:
        with self._lock:
            if not self._free:
                raise RuntimeError(
                    f"more than {MAX_RUNS_PER_PROCESS} concurrent subprocess sandbox runs"
                )
            return 1_000_000 + (os.getpid() % 100_000) * MAX_RUNS_PER_PROCESS + self._free.pop()

    def give_back(self, uid: int) -> None:
        with self._lock:
            self._free.append((uid - 1_000_000) % MAX_RUNS_PER_PROCESS)


_RUN_UIDS = _RunUids()


class SubprocessSandbox(HostSandbox):
    name = "subprocess"

    def __init__(
        self, *, allow_unsafe: bool = False, python: str | None = None, leases: Leases | None = None
    ) -> None:
        if not allow_unsafe:
            raise PermissionError(
                "the subprocess sandbox backend isolates nothing (no filesystem, network or process "
                "isolation); pass allow_unsafe=True (CLI: --allow-unsafe) only for trusted code, "
                "or install bubblewrap / start Docker for a real sandbox"
            )
        self.python = python or _python_for_nobody()
        self.leases = leases or default_leases()
        reap_stale()

    async def _execute(
        self, program: Program, limits: Limits, work: WorkDir
    ) -> tuple[RawRun, bool]:
        run_uid = _RUN_UIDS.take()
        try:
            is_root = os.geteuid() == 0  # never run policy code as root, even here
            raw = await run_process(
                program.argv(self.python),
                stdin=program.stdin_bytes(),
                limits=limits,
                cwd=str(work.path),
                env={**ENV, "HOME": str(work.path)},
                preexec_fn=make_preexec(
                    rlimits(limits, has_cgroup=False, with_nproc=True),
                    run_as_uid=run_uid if is_root else None,
                ),
                on_kill=(lambda: _kill_uid(run_uid)) if is_root else None,
            )
            return raw, False
        finally:
            _RUN_UIDS.give_back(run_uid)


def _python_for_nobody() -> str:
    """Our interpreter if any user may run it; else the system one (a root-only pyenv under
    /root would be unreachable once the child drops to uid 65534)."""
    exe = os.path.realpath(sys.executable)
    if os.geteuid() != 0 or _is_world_executable(exe):
        return exe
    return shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or exe


def _is_world_executable(path: str) -> bool:
    parts = path.split("/")
    dirs = ["/".join(parts[:i]) or "/" for i in range(1, len(parts))]
    return all(os.stat(d).st_mode & 0o001 for d in dirs) and bool(os.stat(path).st_mode & 0o001)


async def _kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid` (kill(-1) sent as that uid): a setsid'd daemon escapes
    the process-group kill, never this. Repeated because a fork bomb forks while we kill."""
    for _ in range(3):
        with contextlib.suppress(OSError):
            proc = await asyncio.create_subprocess_exec(
                "kill",
                "-9",
                "--",
                "-1",
                user=uid,
                group=uid,
                extra_groups=[],
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
            await proc.wait()
