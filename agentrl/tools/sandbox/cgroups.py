"""Per-run memory and pids cgroups (v1 or v2), nested under this process's own cgroup so any
limit the host already puts on us still applies. Used only where the hierarchy is writable."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
from dataclasses import dataclass
from pathlib import Path

_ROOT = Path("/sys/fs/cgroup")
_GROUP = "agentrl-sandbox"
_counter = itertools.count()


def _own_paths() -> dict[str, str]:
    """controller ("memory", "pids", or "" for v2) -> this process's cgroup path."""
    out: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def _parents() -> list[Path] | None:
    """Writable parent dirs for our run cgroups: [memory, pids] on v1, [unified] on v2."""
    own = _own_paths()
    v1 = [_ROOT / c / own.get(c, "/").lstrip("/") / _GROUP for c in ("memory", "pids")]
    if all((_ROOT / c / "cgroup.procs").exists() for c in ("memory", "pids")):
        return v1 if all(_ensure_dir(p) for p in v1) else None
    controllers = _ROOT / "cgroup.controllers"
    if controllers.exists() and {"memory", "pids"} <= set(controllers.read_text().split()):
        # v2 only lets leaf cgroups hold processes: our group enables memory+pids for its children.
        parent = _ROOT / own.get("", "/").lstrip("/") / _GROUP
        if _ensure_dir(parent):
            with contextlib.suppress(OSError):
                (parent / "cgroup.subtree_control").write_text("+memory +pids")
                return [parent]
    return None


def _ensure_dir(path: Path) -> bool:
    try:
        path.mkdir(exist_ok=True)
        return os.access(path / "cgroup.procs", os.W_OK)
    except OSError:
        return False


@dataclass
class RunCgroup:
    """The cgroup(s) of one run. `procs_files` are written by the child before exec."""

    dirs: list[Path]
    is_v2: bool

    @classmethod
    def create(cls, memory_bytes: int, max_processes: int) -> RunCgroup | None:
        """A fresh cgroup with the limits set, or None where cgroups are not writable."""
        parents = _parents()
        if parents is None:
            return None
        name = f"{os.getpid()}-{next(_counter)}"
        dirs = [p / name for p in parents]
        try:
            for d in dirs:
                d.mkdir()
            cg = cls(dirs, is_v2=len(dirs) == 1)
            cg._set_limits(memory_bytes, max_processes)
            return cg
        except OSError:
            for d in dirs:
                with contextlib.suppress(OSError):
                    d.rmdir()
            return None

    def _set_limits(self, memory_bytes: int, max_processes: int) -> None:
        if self.is_v2:
            (self.dirs[0] / "memory.max").write_text(str(memory_bytes))
            with contextlib.suppress(OSError):  # no swap for sandboxes, where swap exists
                (self.dirs[0] / "memory.swap.max").write_text("0")
            (self.dirs[0] / "pids.max").write_text(str(max_processes))
            return
        mem, pids = self.dirs
        (mem / "memory.limit_in_bytes").write_text(str(memory_bytes))
        with contextlib.suppress(OSError):
            (mem / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
        (pids / "pids.max").write_text(str(max_processes))

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def pids(self) -> set[int]:
        out: set[int] = set()
        for f in self.procs_files:
            with contextlib.suppress(OSError):
                out |= {int(p) for p in Path(f).read_text().split()}
        return out

    def is_oom(self) -> bool:
        """Whether the kernel OOM-killed (or refused memory to) something in this run."""
        mem = self.dirs[0]
        try:
            text = (mem / ("memory.events" if self.is_v2 else "memory.oom_control")).read_text()
        except OSError:
            return False
        counts = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
        if "oom_kill" in counts:
            return int(counts["oom_kill"]) > 0
        if self.is_v2:
            return int(counts.get("oom", 0)) > 0
        with contextlib.suppress(OSError, ValueError):
            return int((mem / "memory.failcnt").read_text()) > 0
        return False

    async def kill_all(self) -> None:
        """SIGKILL every process in the run until none is left (a fork bomb keeps forking while
        we sweep; the pids limit bounds it, so the loop converges)."""
        kill_file = self.dirs[0] / "cgroup.kill"
        if self.is_v2 and kill_file.exists():
            with contextlib.suppress(OSError):
                kill_file.write_text("1")
        for _ in range(200):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(0.005)

    async def remove(self) -> None:
        await self.kill_all()
        for d in self.dirs:
            for _ in range(100):  # rmdir is EBUSY until the last killed task is gone
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    await asyncio.sleep(0.01)


def reap_stale() -> None:
    """Remove run cgroups left by agentrl processes that no longer exist."""
    parents = _parents() or []
    for parent in parents:
        for d in parent.iterdir() if parent.exists() else []:
            owner = d.name.split("-", 1)[0]
            if d.is_dir() and owner.isdigit() and not Path(f"/proc/{owner}").exists():
                with contextlib.suppress(OSError, ValueError):
                    for pid in (d / "cgroup.procs").read_text().split():
                        os.kill(int(pid), signal.SIGKILL)
                with contextlib.suppress(OSError):
                    d.rmdir()


def live_run_cgroups() -> list[Path]:
    """This process's run cgroups that still exist (empty after every run has ended)."""
    prefix = f"{os.getpid()}-"
    return [
        d for p in _parents() or [] for d in p.iterdir() if d.is_dir() and d.name.startswith(prefix)
    ]
