"""The run directory's guards: refuse to write over another run, one writer at a time (a flock),
and the saved config a `--resume` restores."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from agentrl.config import ConfigError

LOCK_NAME = ".agentrl.lock"
CONFIG_NAME = "run_config.json"
# Where a resumed run may differ from the saved one without asking: where it came from / goes.
NOT_COMPARED = ("checkpoint.resume", "checkpoint.save", "checkpoint.overwrite")


class RunDirError(ConfigError):
    """The run directory cannot be used as asked; the message names it and the fix."""


def check_writable(run_dir: Path, *, is_resume: bool, is_overwrite: bool) -> None:
    """A directory holding another run's files is refused unless resumed or overwritten;
    `--overwrite` clears only a directory an agentrl run wrote (its run_config.json), never
    someone's other files."""
    if not str(run_dir) or str(run_dir) == ".":
        raise RunDirError(
            f"--save {str(run_dir)!r} is the current directory; pass a directory of its own for "
            "the run, e.g. --save runs/my_run"
        )
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"--save {run_dir} is a file; pass a directory for the run")
    if is_locked(run_dir):  # a live run: no advice about its files applies
        raise _locked(run_dir)
    if is_resume or not run_dir.is_dir():
        return
    files = [p for p in run_dir.iterdir() if p.name != LOCK_NAME]
    if not files:
        return
    is_run = (run_dir / CONFIG_NAME).is_file()
    if is_overwrite and not is_run:
        raise RunDirError(
            f"--save {run_dir} --overwrite: the directory holds files but no {CONFIG_NAME}, so "
            "no agentrl run wrote it; --overwrite clears only a run directory. Choose another "
            "--save"
        )
    if is_overwrite:
        return
    has_checkpoint = any((run_dir / "checkpoints").glob("step_*"))
    if is_run and has_checkpoint:
        raise RunDirError(
            f"--save {run_dir}: an earlier run is there; continue it with --resume {run_dir}, "
            "or start over in it with --overwrite"
        )
    if is_run:
        raise RunDirError(
            f"--save {run_dir}: an earlier run that saved no checkpoint is there; start over in "
            "it with --overwrite"
        )
    raise RunDirError(
        f"--save {run_dir}: the directory holds files and no agentrl run wrote it; choose "
        "another --save"
    )


@contextlib.contextmanager
def hold_lock(run_dir: Path) -> Iterator[None]:
    """Exclusive flock on `run_dir/.agentrl.lock` while the run writes; the kernel drops it when
    the process dies, so a crashed run never leaves a stale lock."""
    lock = FileLock(run_dir / LOCK_NAME)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        held = lock.acquire(timeout=0)
    except Timeout:
        raise _locked(run_dir) from None
    except OSError as e:
        raise RunDirError(
            f"--save {run_dir}: cannot create it ({e.strerror}); pass a writable directory"
        ) from None
    with held:
        yield


def is_locked(run_dir: Path) -> bool:
    """Whether a live process holds `run_dir`'s lock (asked without creating anything)."""
    if not (run_dir / LOCK_NAME).is_file():
        return False
    lock = FileLock(run_dir / LOCK_NAME)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return True
    except OSError:
        return False  # not ours to open: the checks that follow say what is wrong
    lock.release()
    return False


def _locked(run_dir: Path) -> RunDirError:
    return RunDirError(
        f"--save {run_dir}: another agentrl run is writing to this directory (it holds "
        f"{run_dir / LOCK_NAME}); wait for it to finish, or choose another --save"
    )


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
    return _read_config(resumed_run_dir(resume) / CONFIG_NAME)


def resumed_run_dir(resume: str) -> Path:
    """The run directory `--resume` names: it, or the run dir above its checkpoints or step,
    whichever holds the run_config.json. A resumed run trains there, wherever it was copied
    from."""
    path = Path(resume)
    for candidate in (path, path.parent, path.parent.parent):
        if (candidate / CONFIG_NAME).is_file():
            return candidate
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


def _read_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RunDirError(
            f"--resume: {path} is not valid JSON ({e.msg}, line {e.lineno})"
        ) from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise RunDirError(
            f"--resume: {path} is not a run config (an object of sections, each an object of "
            "fields); restore it from the run's checkpoint or start a new run"
        )
    return data
