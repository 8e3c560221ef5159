"""Bubblewrap backend: fresh user, pid, net, mount, ipc and uts namespaces per run; read-only
system dirs, a tmpfs work dir, cleared environment, uid 65534, rlimits, and cgroup memory
and pids limits where the hierarchy is writable."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys

from agentrl.tools.sandbox import cgroups, workdir
from agentrl.tools.sandbox.base import Limits, Program, SandboxUnavailable
from agentrl.tools.sandbox.cgroups import RunCgroup
from agentrl.tools.sandbox.leases import Leases, default_leases
from agentrl.tools.sandbox.process import ENV, RawRun, make_preexec, rlimits, run_process
from agentrl.tools.sandbox.workdir import HostSandbox, StartError, WorkDir

SANDBOX_UID = 65534
WORK = "/work"
INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install -y bubblewrap; Fedora: dnf install bubblewrap)"


def host_python() -> tuple[str, str]:
    """(interpreter, install prefix) of the Python running agentrl, venvs resolved to the base
    install: the sandbox calls the real interpreter, not a shim."""
    return os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)


class BubblewrapSandbox(HostSandbox):
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

    async def _execute(
        self, program: Program, limits: Limits, work: WorkDir
    ) -> tuple[RawRun, bool]:
        cg = (
            RunCgroup.create(limits.memory_bytes, limits.max_processes)
            if self.use_cgroups
            else None
        )
        status_r, status_w = os.pipe()
        try:
            argv = [*self._bwrap_args(limits, work, status_w), *program.argv(self.python)]
            preexec = make_preexec(
                rlimits(limits, has_cgroup=cg is not None),
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
                raise StartError(f"bwrap failed to start the program: {msg}")
            return raw, cg.is_oom() if cg else False
        finally:
            for fd in (status_r, status_w):
                if fd >= 0:
                    os.close(fd)
            if cg is not None:
                await cg.remove()

    def _bwrap_args(self, limits: Limits, work: WorkDir, status_fd: int) -> list[str]:
        args = [
            self.bwrap,
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            "--json-status-fd",
            str(status_fd),
            *_bind_args(self.ro_binds),
        ]
        args += ["--dev", "/dev", "--proc", "/proc"]
        args += ["--size", str(limits.max_file_size_bytes), "--tmpfs", "/tmp"]
        args += ["--bind", str(work.path), WORK, "--chdir", WORK, "--remount-ro", "/"]
        env = {**ENV, "HOME": WORK}
        args += ["--clearenv", *[a for k, v in env.items() for a in ("--setenv", k, v)]]
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


def _bind_args(paths: tuple[str, ...] | list[str]) -> list[str]:
    """Each path read-only at its own place (a symlink as the same symlink), where it exists."""
    args: list[str] = []
    for path in paths:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.exists(path):
            args += ["--ro-bind", path, path]
    return args


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

    probe = [bwrap, "--unshare-all", *_bind_args(_system_binds())]
    probe += ["--dev", "/dev", "--proc", "/proc", "--", "true"]
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
