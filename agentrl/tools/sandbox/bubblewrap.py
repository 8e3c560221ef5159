"""Bubblewrap backend: fresh user, pid, net, mount, ipc and uts namespaces per run; read-only
system dirs, a tmpfs work dir, cleared environment, uid 65534, rlimits, and cgroup memory
and pids limits where the hierarchy is writable."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time

from agentrl.tools.sandbox import cgroups, workdir
from agentrl.tools.sandbox.base import Limits, Program, SandboxResult, SandboxUnavailable
from agentrl.tools.sandbox.cgroups import RunCgroup
from agentrl.tools.sandbox.leases import Leases, default_leases
from agentrl.tools.sandbox.process import (
    make_preexec,
    rlimits,
    run_process,
    sandbox_error,
    to_result,
)
from agentrl.tools.sandbox.workdir import WorkDir

SANDBOX_UID = 65534
WORK = "/work"
_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": WORK,
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
}
INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install -y bubblewrap; Fedora: dnf install bubblewrap)"


def host_python() -> tuple[str, str]:
    """(interpreter, install prefix) of the Python running agentrl, venvs resolved to the base
    install: the sandbox calls the real interpreter, not a shim."""
    return os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)


class BubblewrapSandbox:
    name = "bubblewrap"

    def __init__(
        self,
        *,
        python: str | None = None,
        leases: Leases | None = None,
        use_cgroups: bool = True,
        ro_binds: tuple[str, ...] = (),
    ) -> None:
        self.bwrap = shutil.which("bwrap")
        if self.bwrap is None:
            raise SandboxUnavailable(
                f"bubblewrap backend: `bwrap` not found on PATH; {INSTALL_HINT}"
            )
        default_python, prefix = host_python()
        self.python = python or default_python
        self.ro_binds = tuple(dict.fromkeys((*_system_binds(), prefix, *ro_binds)))
        self.leases = leases or default_leases()
        self.use_cgroups = use_cgroups
        workdir.reap_stale()
        if use_cgroups:
            cgroups.reap_stale()

    async def run(self, program: Program, limits: Limits | None = None) -> SandboxResult:
        limits = limits or Limits()
        async with self.leases.lease():
            return await self._run(program, limits)

    async def close(self) -> None:
        return None

    async def _run(self, program: Program, limits: Limits) -> SandboxResult:
        start = time.monotonic()
        try:
            work = WorkDir.create(limits.max_file_size_bytes)
        except OSError as e:
            return sandbox_error(self.name, f"cannot create a work dir: {e}")
        cg = (
            RunCgroup.create(limits.memory_bytes, limits.max_processes)
            if self.use_cgroups
            else None
        )
        status_r, status_w = os.pipe()
        try:
            work.write_files(program.all_files())
            argv = [*self._bwrap_args(limits, work, status_w), *self._command(program)]
            preexec = make_preexec(
                rlimits(
                    limits, address_space_bytes=_address_space(limits, has_cgroup=cg is not None)
                ),
                cg.procs_files if cg else (),
            )
            raw = await run_process(
                argv,
                stdin=program.stdin_bytes(),
                limits=limits,
                env={},
                preexec_fn=preexec,
                on_kill=cg.kill_all if cg else None,
                pass_fds=(status_w,),
            )
            os.close(status_w)
            status_w = -1
            if not _child_started(status_r):
                msg = raw.stderr.decode("utf-8", "replace").strip()
                return sandbox_error(
                    self.name, f"bwrap failed to start the program: {msg}", time.monotonic() - start
                )
            files = work.read_files(program.fetch_files, limits.max_file_size_bytes)
            return to_result(
                raw, backend=self.name, is_oom=cg.is_oom() if cg else False, files=files
            )
        except OSError as e:
            return sandbox_error(self.name, f"{type(e).__name__}: {e}", time.monotonic() - start)
        finally:
            for fd in (status_r, status_w):
                if fd >= 0:
                    os.close(fd)
            if cg is not None:
                await cg.remove()
            work.remove()

    def _bwrap_args(self, limits: Limits, work: WorkDir, status_fd: int) -> list[str]:
        args = [
            self.bwrap,
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            "--json-status-fd",
            str(status_fd),
        ]
        for path in self.ro_binds:
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.exists(path):
                args += ["--ro-bind", path, path]
        args += ["--dev", "/dev", "--proc", "/proc"]
        args += ["--size", str(limits.max_file_size_bytes), "--tmpfs", "/tmp"]
        args += ["--bind", str(work.path), WORK, "--chdir", WORK, "--remount-ro", "/"]
        args += ["--clearenv", *[a for k, v in _ENV.items() for a in ("--setenv", k, v)]]
        args += [
            "--uid",
            str(SANDBOX_UID),
            "--gid",
            str(SANDBOX_UID),
            "--hostname",
            "sandbox",
            "--",
        ]
        return args

    def _command(self, program: Program) -> list[str]:
        return program.command if program.command is not None else [self.python, "main.py"]


def _address_space(limits: Limits, *, has_cgroup: bool) -> int:
    """RLIMIT_AS: the memory limit itself without a cgroup; with one, a looser backstop that
    turns a huge allocation into an instant MemoryError instead of a slow OOM-kill, while
    leaving room for the virtual reservations (thread stacks, arenas) real programs make."""
    return 2 * limits.memory_bytes + (256 << 20) if has_cgroup else limits.memory_bytes


def _system_binds() -> list[str]:
    """Read-only system dirs; /etc only for the dynamic loader's cache (no passwd, no shadow)."""
    paths = [
        "/usr",
        "/bin",
        "/sbin",
        "/lib",
        "/lib64",
        "/lib32",
        "/etc/ld.so.cache",
        "/etc/alternatives",
    ]
    return [p for p in paths if os.path.lexists(p)]


def _child_started(status_fd: int) -> bool:
    """bwrap writes {"child-pid": N} once the program is exec'd: no line means bwrap itself
    failed, which must not pass for the program's own error (nor be fakeable by it)."""
    os.set_blocking(status_fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(status_fd, 65536):
            data += chunk
    for line in data.splitlines():
        with contextlib.suppress(ValueError):
            if "child-pid" in json.loads(line):
                return True
    return False


def is_available() -> tuple[bool, str]:
    """Whether bwrap exists and can create namespaces here (a run of `true`)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return False, f"`bwrap` not found; {INSTALL_HINT}"
    import subprocess

    binds = [a for p in _system_binds() if not os.path.islink(p) for a in ("--ro-bind", p, p)]
    links = [
        a for p in _system_binds() if os.path.islink(p) for a in ("--symlink", os.readlink(p), p)
    ]
    probe = [
        bwrap,
        "--unshare-all",
        *binds,
        *links,
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--",
        "true",
    ]
    try:
        done = subprocess.run(probe, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"bwrap cannot run: {e}"
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip()
        return (
            False,
            f"bwrap cannot create namespaces here ({why}); enable unprivileged user namespaces or run as root",
        )
    return True, ""
