"""A run's host-side work directory: a size-capped tmpfs where we may mount one (root),
else a plain temp dir. Files go in before the run and come out without following links.
`HostSandbox`: the run of the backends that use one (bubblewrap, subprocess)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from agentrl.tools.sandbox.base import Limits, Program, SandboxResult
from agentrl.tools.sandbox.docker_boot import read_files
from agentrl.tools.sandbox.leases import Leases
from agentrl.tools.sandbox.process import RawRun, sandbox_error, to_result

PREFIX = "agentrl-sbx-"
_MNT_DETACH = 2
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _mount_tmpfs(path: str, size_bytes: int) -> bool:
    if os.geteuid() != 0:
        return False
    opts = f"size={size_bytes},mode=0777".encode()
    return _libc.mount(b"tmpfs", path.encode(), b"tmpfs", 0, opts) == 0


@dataclass
class WorkDir:
    path: Path
    is_tmpfs: bool

    @classmethod
    def create(cls, size_bytes: int) -> WorkDir:
        path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
        os.chmod(path, 0o777)  # the sandbox's uid may differ from ours
        return cls(Path(path), _mount_tmpfs(path, size_bytes))

    def write_files(self, files: dict[str, bytes]) -> None:
        for name, data in files.items():
            target = self.path / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            target.chmod(0o666)

    def remove(self) -> None:
        if self.is_tmpfs:
            _libc.umount2(str(self.path).encode(), _MNT_DETACH)
        shutil.rmtree(self.path, ignore_errors=True)


def reap_stale() -> None:
    """Remove work dirs (and their tmpfs mounts) left by agentrl processes that died hard."""
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        owner = path.name[len(PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            WorkDir(path, is_tmpfs=os.path.ismount(path)).remove()


class StartError(Exception):
    """The sandbox itself failed to start the program (never the program's own error)."""


class HostSandbox:
    """A run on this host: under a lease, in a fresh work dir holding the program's files,
    which is removed after its `fetch_files` are read back. Subclasses `_execute` the program."""

    name: str
    leases: Leases

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
        try:
            work.write_files(program.all_files())
            raw, is_oom = await self._execute(program, limits, work)
            files = read_files(work.path, program.fetch_files, limits.max_file_size_bytes)
            return to_result(raw, backend=self.name, is_oom=is_oom, files=files)
        except StartError as e:
            return sandbox_error(self.name, str(e), time.monotonic() - start)
        except OSError as e:
            return sandbox_error(self.name, f"{type(e).__name__}: {e}", time.monotonic() - start)
        finally:
            work.remove()

    async def _execute(
        self, program: Program, limits: Limits, work: WorkDir
    ) -> tuple[RawRun, bool]:
        """Run the program in `work`: what the host saw, and whether memory ran out (OOM-kill)."""
        raise NotImplementedError
