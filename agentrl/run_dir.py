"""The run directory's guards: refuse to write over another run, one writer at a time (a flock),
and the saved config a `--resume` restores."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentrl.config import ConfigError

LOCK_NAME = ".agentrl.lock"
CONFIG_NAME = "run_config.json"
# Where a resumed run may differ from the saved one without asking: where it came from / goes.
NOT_COMPARED = ("checkpoint.resume", "checkpoint.save", "checkpoint.overwrite")


class RunDirError(ConfigError):
    """The run directory cannot be used as asked; the message names it and the fix."""


def check_writable(run_dir: Path, *, is_resume: bool, is_overwrite: bool) -> None:
    """A directory holding another run's files is refused unless resumed or overwritten."""
    if is_resume or is_overwrite or not run_dir.is_dir():
        return
    if any(p.name != LOCK_NAME for p in run_dir.iterdir()):
        raise RunDirError(
            f"--save {run_dir}: the directory is not empty (an earlier run?); continue it with "
            f"--resume {run_dir}, or start over in it with --overwrite"
        )


@contextlib.contextmanager
def hold_lock(run_dir: Path) -> Iterator[None]:
    """Exclusive flock on `run_dir/.agentrl.lock` while the run writes; the kernel drops it when
    the process dies, so a crashed run never leaves a stale lock."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirError(
            f"--save {run_dir}: another agentrl run is writing to this directory (it holds "
            f"{run_dir / LOCK_NAME}); wait for it to finish, or choose another --save"
        ) from None
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def clear(run_dir: Path) -> None:
    """`--overwrite`: remove the earlier run's files (the lock is held, so none is in use)."""
    for p in run_dir.iterdir():
        if p.name == LOCK_NAME:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def saved_config(resume: str) -> dict[str, Any]:
    """The run_config.json of the run `resume` names (the run dir, its checkpoints or a step)."""
    path = Path(resume)
    for candidate in (path, path.parent, path.parent.parent):
        if (candidate / CONFIG_NAME).is_file():
            return json.loads((candidate / CONFIG_NAME).read_text())
    if not path.exists():
        raise RunDirError(f"--resume {resume}: no such directory; pass the --save dir of a run")
    raise RunDirError(
        f"--resume {resume}: no {CONFIG_NAME} there or above it; pass the --save dir of a run "
        "that agentrl train wrote"
    )


def config_diff(saved: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`section.field: old -> new` for every field that differs (NOT_COMPARED aside)."""
    lines = []
    for section, fields in new.items():
        for name, value in fields.items():
            key = f"{section}.{name}"
            old = saved.get(section, {}).get(name, value)
            if key not in NOT_COMPARED and old != value:
                lines.append(f"{key}: {old!r} -> {value!r}")
    return lines
