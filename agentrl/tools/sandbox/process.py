"""Run one child process under a wall clock and an output budget, shared by every backend.

Output is counted while it streams (a program printing 1 GB never gets buffered) and the
child's whole process group is killed on any limit and again at the end, always.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from agentrl.tools.sandbox.base import Limits, SandboxResult, SandboxStatus

_READ_CHUNK = 1 << 16
_DRAIN_GRACE_S = 1.0
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
"""The whole environment of a sandboxed program, with HOME (its work dir) added by each backend."""


@dataclass
class RawRun:
    """What the host saw of a child: exit code (negative = killed by that signal), bytes kept."""

    returncode: int | None
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    is_timeout: bool = False
    is_output_limit: bool = False
    wall_s: float = 0.0


class _OutputBudget:
    """stdout and stderr share one byte budget; crossing it trips `exceeded`."""

    def __init__(self, max_bytes: int) -> None:
        self.left = max_bytes
        self.exceeded = asyncio.Event()

    async def drain(self, stream: asyncio.StreamReader, sink: bytearray) -> bool:
        """Read until EOF or the budget runs out; returns whether this stream was cut."""
        while True:
            chunk = await stream.read(_READ_CHUNK)
            if not chunk:
                return False
            if len(chunk) > self.left:
                sink += chunk[: self.left]
                self.left = 0
                self.exceeded.set()
                return True
            sink += chunk
            self.left -= len(chunk)


def rlimits(
    limits: Limits, *, has_cgroup: bool, with_nproc: bool | None = None
) -> list[tuple[int, tuple[int, int]]]:
    """The rlimits for a run. CPU gets a one-second gap between SIGXCPU and SIGKILL.
    RLIMIT_AS is the memory limit itself without a cgroup; in one, a looser backstop that turns
    a huge allocation into an instant MemoryError instead of a slow OOM-kill, while leaving room
    for the virtual reservations (thread stacks, arenas) real programs make.
    RLIMIT_NPROC counts per uid and the kernel never applies it to root: by default it is set
    only where we are not root (cgroups cover root)."""
    cpu = limits.cpu_limit_s
    address_space = 2 * limits.memory_bytes + (256 << 20) if has_cgroup else limits.memory_bytes
    out = [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_FSIZE, (limits.max_file_size_bytes, limits.max_file_size_bytes)),
        (resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files)),
        (resource.RLIMIT_CORE, (0, 0)),
        (resource.RLIMIT_AS, (address_space, address_space)),
    ]
    if with_nproc if with_nproc is not None else os.geteuid() != 0:
        out.append((resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes)))
    return out


def make_preexec(
    limits: list[tuple[int, tuple[int, int]]],
    cgroup_procs: Sequence[str] = (),
    run_as_uid: int | None = None,
) -> Callable[[], None]:
    """Runs in the child between fork and exec: join the cgroups first (so every descendant is
    counted from its first instruction), lower the rlimits, then drop to `run_as_uid`."""

    def preexec() -> None:
        pid = str(os.getpid()).encode()
        for path in cgroup_procs:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, pid)
            finally:
                os.close(fd)
        for which, value in limits:
            resource.setrlimit(which, value)
        if run_as_uid is not None:
            os.setgroups([])
            os.setresgid(run_as_uid, run_as_uid, run_as_uid)
            os.setresuid(run_as_uid, run_as_uid, run_as_uid)

    return preexec


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def run_process(
    argv: Sequence[str],
    *,
    stdin: bytes,
    limits: Limits,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
    on_kill: Callable[[], Awaitable[None]] | None = None,
    pass_fds: Sequence[int] = (),
) -> RawRun:
    """Start `argv` in a new session, feed stdin, stream output under the budget, and kill the
    whole group when it exits, times out, overflows, or this coroutine is cancelled.
    `on_kill` is the backend's extra sweep (a cgroup, a container) run on the same paths."""
    start = time.monotonic()
    spawn = asyncio.ensure_future(
        asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=cwd,
            env=env if env is not None else {},
            start_new_session=True,
            preexec_fn=preexec_fn,
            pass_fds=tuple(pass_fds),
        )
    )
    proc, is_cancelled = await _started(spawn)
    budget = _OutputBudget(limits.max_output_bytes)
    out = bytearray()
    err = bytearray()
    readers = [
        asyncio.create_task(budget.drain(proc.stdout, out)),  # type: ignore[arg-type]
        asyncio.create_task(budget.drain(proc.stderr, err)),  # type: ignore[arg-type]
    ]
    feeder = asyncio.create_task(_feed(proc, stdin))
    waiter = asyncio.create_task(_exited(proc))
    tripwire = asyncio.create_task(budget.exceeded.wait())
    try:
        if is_cancelled:
            raise asyncio.CancelledError
        await asyncio.wait(
            {waiter, tripwire}, timeout=limits.timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        is_output_limit = budget.exceeded.is_set()
        is_timeout = not waiter.done() and not is_output_limit
    finally:
        # Always, even after a clean exit: a daemonized grandchild must not outlive the run.
        kill_group(proc.pid)
        if on_kill is not None:
            await on_kill()
        await _exited(proc)
        tripwire.cancel()
        feeder.cancel()
        _, pending = await asyncio.wait(readers, timeout=_DRAIN_GRACE_S)
        for task in pending:  # something outside our reach still holds a pipe open
            task.cancel()
        if pending:
            with contextlib.suppress(Exception):
                proc._transport.close()  # type: ignore[attr-defined]
    wall_s = time.monotonic() - start
    cut = [t.result() if t.done() and not t.cancelled() else True for t in readers]
    return RawRun(
        proc.returncode, bytes(out), bytes(err), cut[0], cut[1], is_timeout, is_output_limit, wall_s
    )


async def _started(
    spawn: asyncio.Future[asyncio.subprocess.Process],
) -> tuple[asyncio.subprocess.Process, bool]:
    """The child, once its pipes are connected, and whether we were cancelled meanwhile. The
    start is never cancelled: asyncio (3.11) then kills the child and waits for pipes that never
    connect, forever, and a bwrap killed that early leaves its inner process running. Started,
    the child is stopped like any other, group and cgroup swept."""
    is_cancelled = False
    while True:
        try:
            return await asyncio.shield(spawn), is_cancelled
        except asyncio.CancelledError:
            if spawn.cancelled():
                raise
            is_cancelled = True


async def _exited(proc: asyncio.subprocess.Process) -> None:
    """Returns once the child has exited. Not `proc.wait()`: that also waits for stdout and
    stderr to close, which a daemonized grandchild holding them would put off forever."""
    delay = 0.001
    while proc.returncode is None:
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)


async def _feed(proc: asyncio.subprocess.Process, data: bytes) -> None:
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        if data:
            proc.stdin.write(data)
            await proc.stdin.drain()
        proc.stdin.close()


def classify(raw: RawRun, *, is_oom: bool = False) -> tuple[SandboxStatus, str | None]:
    """Map what happened to a status; the order matters (our own kills come first)."""
    if raw.is_output_limit:
        return SandboxStatus.OUTPUT_LIMIT, "stdout + stderr passed max_output_bytes"
    if raw.is_timeout:
        return SandboxStatus.TIMEOUT, "wall-clock limit (timeout_s)"
    if raw.returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU):  # bwrap reports 128 + signal
        return SandboxStatus.TIMEOUT, "CPU-time limit (cpu_s)"
    if raw.returncode == 0:
        return SandboxStatus.OK, None
    if is_oom or _ends_with_memory_error(raw.stderr):
        return SandboxStatus.MEMORY, "memory limit (memory_mb)"
    return SandboxStatus.RUNTIME_ERROR, None


def _ends_with_memory_error(stderr: bytes) -> bool:
    lines = stderr.rstrip().splitlines()
    return bool(lines) and lines[-1].startswith(b"MemoryError")


def to_result(
    raw: RawRun, *, backend: str, is_oom: bool = False, files: dict[str, bytes] | None = None
) -> SandboxResult:
    status, why = classify(raw, is_oom=is_oom)
    return SandboxResult(
        status=status,
        exit_code=raw.returncode,
        stdout=raw.stdout.decode("utf-8", "replace"),
        stderr=raw.stderr.decode("utf-8", "replace"),
        wall_s=raw.wall_s,
        stdout_truncated=raw.stdout_truncated,
        stderr_truncated=raw.stderr_truncated,
        files=files or {},
        backend=backend,
        error=why,
    )


def sandbox_error(backend: str, message: str, wall_s: float = 0.0) -> SandboxResult:
    return SandboxResult(
        SandboxStatus.SANDBOX_ERROR, None, "", "", wall_s, backend=backend, error=message
    )
