"""Disk space for checkpoints: the up-front check (will the next one fit beside the last?) and
the one-line error a failed save becomes — bytes needed, bytes free, the last good checkpoint
and how to go on — instead of a storage library's traceback."""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import KW_ONLY, dataclass
from pathlib import Path

# How a full disk shows through the layers a save goes through: the OS, torch's zip writer
# (torch.save, and DCP's files) and Ray's wrapped remote errors, which keep only the text.
_SPACE_MARKERS = ("no space left on device", "disk quota exceeded", "unexpected pos")
_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


@dataclass(eq=False, repr=False)  # an exception's own identity and repr
class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; `str()` is one line a user can act on. The earlier
    checkpoint (`last_good`) is intact: a save publishes by rename only once complete."""

    reason: str
    _: KW_ONLY
    step: int
    root: Path
    needed_bytes: int
    free_bytes: int
    last_good: Path | None
    resume_command: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.describe())

    def describe(self) -> str:
        needed = f"~{self.needed_bytes:,}" if self.needed_bytes else "an unknown number of"
        where = (
            f"the last good checkpoint is {self.last_good}"
            if self.last_good is not None
            else "no earlier checkpoint was saved"
        )
        line = (
            f"checkpoint of step {self.step} not saved: {self.reason} in {self.root} (it needs "
            f"{needed} bytes, {self.free_bytes:,} are free); {where}"
        )
        if self.resume_command and self.last_good is not None:
            line += f"; free space, then continue with: {self.resume_command}"
        elif self.resume_command:
            line += "; free space and start the run again"
        return line


def tree_bytes(path: Path | None) -> int:
    """Bytes the files under `path` take on disk (allocated blocks, what a filesystem charges)."""
    if path is None or not path.exists():
        return 0
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:  # removed while we walked
                continue
            total += st.st_blocks * 512 or st.st_size  # some filesystems report no blocks
    return total


def check_fits(root: Path, step: int, last_good: Path | None) -> int:
    """Refuse, before writing anything, a save that cannot fit: the next checkpoint is taken to
    be as large as the last (the same tensors), and both exist until the new one is published.
    Returns that size (0 when there is no earlier checkpoint to measure)."""
    needed = tree_bytes(last_good)
    free = shutil.disk_usage(root).free
    if needed > free:
        raise CheckpointSaveError(
            "not enough free space",
            step=step,
            root=root,
            needed_bytes=needed,
            free_bytes=free,
            last_good=last_good,
        )
    return needed


def save_failure(
    error: BaseException, *, step: int, root: Path, needed_bytes: int, last_good: Path | None
) -> CheckpointSaveError | None:
    """The one-line error for a save that failed with `error` (after its partial files were
    removed), or None when `error` is no storage failure (a bug keeps its traceback)."""
    if (
        isinstance(error, KeyboardInterrupt | SystemExit)
        or type(error).__name__ == "CancelledError"
    ):
        return None
    reason = _storage_reason(error)
    if reason is None:
        return None
    return CheckpointSaveError(
        reason,
        step=step,
        root=root,
        needed_bytes=needed_bytes,
        free_bytes=shutil.disk_usage(root).free,
        last_good=last_good,
    )


def _storage_reason(error: BaseException) -> str | None:
    for e in _chain(error):
        if isinstance(e, OSError) and e.errno in _SPACE_ERRNOS:
            return "no space left on device"
    text = " ".join(str(e) for e in _chain(error)).lower()
    if any(marker in text for marker in _SPACE_MARKERS):
        return "no space left on device"
    for e in _chain(error):
        if isinstance(e, OSError):  # permission denied, read-only filesystem, ...
            return (e.strerror or str(e) or type(e).__name__).splitlines()[0]
    return None


def _chain(error: BaseException) -> list[BaseException]:
    """`error` and the errors it was raised from or during, once each."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__]
    return seen
