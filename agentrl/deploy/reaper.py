"""The reaper of a local Ray: a watcher in its own session that kills what is left of the Ray
processes a driver started once that driver is gone without `ray.shutdown()` (a SIGKILL). Ray
fate-shares gcs_server and raylet with the driver, but raylet's agents outlive it for minutes.
Standard library only: it runs as `python -I reaper.py` without importing agentrl."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

Proc = tuple[int, int]  # (pid, start time in clock ticks): a pid alone may be reused

_INTERVAL_S = 0.5
_GRACE_S = 2.0


def process_table() -> dict[Proc, int]:
    """Every live (non-zombie) process and its parent pid, from /proc (empty without one)."""
    pids = [int(n) for n in os.listdir("/proc") if n.isdigit()] if os.path.isdir("/proc") else []
    return {(pid, stat[1]): stat[0] for pid in pids if (stat := _stat(pid)) is not None}


def identity(pid: int) -> Proc | None:
    stat = _stat(pid)
    return None if stat is None else (pid, stat[1])


def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, start time) of a live process; None when it is gone or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces and ")"
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[19])


def children(pid: int) -> set[Proc]:
    return {p for p, ppid in process_table().items() if ppid == pid}


def with_descendants(known: set[Proc], table: dict[Proc, int]) -> set[Proc]:
    """`known` (those still alive) and every live descendant of theirs in `table`."""
    found = {p for p in known if p in table}
    pids = {pid for pid, _ in found}
    while new := {p for p, ppid in table.items() if ppid in pids and p not in found}:
        found |= new
        pids |= {pid for pid, _ in new}
    return found


def watch(driver: Proc, roots: set[Proc]) -> set[Proc]:
    """Remember the roots' descendants while the driver lives. Returns those still alive when it
    is gone (empty when they all ended first: `ray.shutdown()` ran)."""
    remembered = set(roots)
    while True:
        table = process_table()
        remembered = with_descendants(remembered, table)
        if not remembered or driver not in table:
            return remembered
        time.sleep(_INTERVAL_S)


def kill(procs: set[Proc], grace_s: float = _GRACE_S, max_wait_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`; whatever they spawn meanwhile goes too. Gives up
    after `max_wait_s` (a process stuck in the kernel ignores even SIGKILL)."""
    t0 = time.monotonic()
    termed: set[Proc] = set()
    while (procs := with_descendants(procs, process_table())) and (
        time.monotonic() - t0 < max_wait_s
    ):
        is_late = time.monotonic() - t0 >= grace_s
        for proc in procs if is_late else procs - termed:
            _signal(proc, signal.SIGKILL if is_late else signal.SIGTERM)
        termed |= procs
        time.sleep(0.1)


def _signal(proc: Proc, sig: int) -> None:
    try:
        fd = os.pidfd_open(proc[0])  # pins the process: once its start time matches, it is ours
    except ProcessLookupError:
        return
    except OSError:  # no pidfd before Linux 5.3: a plain kill, just after the table was read
        with contextlib.suppress(OSError):
            os.kill(proc[0], sig)
        return
    with contextlib.suppress(OSError):
        if identity(proc[0]) == proc:
            signal.pidfd_send_signal(fd, sig)
    os.close(fd)


def start(roots: set[Proc]) -> bool:
    """Start the reaper of `roots` (the processes `ray.init` started) for this driver. False
    where it could not: no /proc to watch, or the launcher failed."""
    me = identity(os.getpid())
    if me is None or not roots:
        return False
    args = [f"{pid}:{start}" for pid, start in (me, *sorted(roots))]
    # Through a launcher that exits at once: the reaper is no child of the driver (no zombie,
    # no Popen to keep) and has its own session (a signal to the driver's group spares it).
    return subprocess.run([sys.executable, "-I", __file__, "--detach", *args]).returncode == 0


def main(argv: list[str]) -> int:
    if argv[0] == "--detach":
        subprocess.Popen(
            [sys.executable, "-I", __file__, *argv[1:]],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        return 0
    driver, *roots = [(int(a), int(b)) for a, b in (x.split(":") for x in argv)]
    kill(watch(driver, set(roots)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
