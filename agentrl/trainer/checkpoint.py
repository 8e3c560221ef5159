"""Atomic checkpoints: `root/step_000123` appears whole or not at all, `root/latest` names the
newest, the last K are kept; plus JSON files and the RNG states as JSON for the loop's extra
state."""

from __future__ import annotations

import base64
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agentrl.trainer.checkpoint_space import (
    CheckpointSaveError,
    check_fits,
    save_failure,
    tree_bytes,
)

STEP_DIR = re.compile(r"^step_(\d+)$")
TMP_PREFIX = ".tmp_step_"
ASIDE_PREFIX = ".prev_"  # `.prev_step_000123`: the old copy while the same step is saved again
LATEST = "latest"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    """fsync every file, then every directory bottom-up, so the rename publishes durable data."""
    for dirpath, _, filenames in os.walk(path, topdown=False):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def save_checkpoint(
    root: str | Path,
    step: int,
    write_fn: Callable[[Path], None],
    *,
    keep_last: int,
    resume_command: str | None = None,
) -> Path:
    """Call `write_fn(tmp_dir)`, then publish tmp_dir as `root/step_{step:06d}` by rename and point
    `root/latest` at it. A crash at any moment leaves the previous checkpoint intact and found.
    A save that cannot fit, or fails in the storage, raises `CheckpointSaveError` (one line, with
    `resume_command` as the way on) and leaves the previous checkpoint as it was."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _recover(root)
    last_good = find_latest(root)
    try:
        needed = check_fits(root, step, last_good)
        final = _write_and_publish(root, step, write_fn, needed, last_good)
    except CheckpointSaveError as e:
        raise (replace(e, resume_command=resume_command) if resume_command else e) from None
    try:
        _write_atomic(root / LATEST, final.name + "\n")
    except OSError:
        # A full disk may refuse even the pointer. Without one, `find_latest` takes the newest
        # step dir: the one just published, not the older one a stale pointer would name.
        (root / LATEST).unlink(missing_ok=True)
    _prune(root, keep_last, keep=final)
    return final


def _write_and_publish(
    root: Path, step: int, write_fn: Callable[[Path], None], needed: int, last_good: Path | None
) -> Path:
    final = root / f"step_{step:06d}"  # what STEP_DIR matches
    tmp = root / f"{TMP_PREFIX}{step:06d}.{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        write_fn(tmp)
        _fsync_tree(tmp)
    except BaseException as e:
        # A failed save leaves nothing behind (after SIGKILL, the next save cleans up).
        written = tree_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        failure = save_failure(
            e, step=step, root=root, needed_bytes=max(needed, written), last_good=last_good
        )
        if failure is not None:
            raise failure from None
        raise
    _publish(tmp, final)
    return final


def _publish(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`. Saving the same step again (e.g. Ctrl-C right after a periodic
    save) moves the old one aside first and deletes it last, so a kill in between leaves one
    of the two (`find_latest` and the next save see the aside copy)."""
    aside = final.with_name(ASIDE_PREFIX + final.name)
    if final.exists():
        if aside.exists():
            shutil.rmtree(aside)
        os.rename(final, aside)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if aside.exists():
        shutil.rmtree(aside)


def _recover(root: Path) -> None:
    """What a killed writer left: its temp dir is deleted (its space counts before the next
    save); an aside copy whose step dir never came back (a kill mid-`_publish`) is put back,
    one whose replacement was published is deleted."""
    for p in list(root.iterdir()):
        if p.name.startswith(TMP_PREFIX) and not p.name.endswith(f".{os.getpid()}"):
            shutil.rmtree(p, ignore_errors=True)
        elif p.name.startswith(ASIDE_PREFIX):
            final = root / p.name.removeprefix(ASIDE_PREFIX)
            if final.exists():
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.rename(p, final)


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints by step; an aside copy stands in for a step dir a kill left missing."""
    found: dict[int, Path] = {}
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        name = p.name.removeprefix(ASIDE_PREFIX)
        m = STEP_DIR.match(name)
        if m and p.is_dir() and (p.name == name or not (root / name).is_dir()):
            found[int(m.group(1))] = p
    return sorted(found.items())


def _prune(root: Path, keep_last: int, *, keep: Path) -> None:
    """Delete all but the newest `keep_last` step dirs (`_recover` took the crashed writers'
    temp dirs when this save began)."""
    for _, path in _step_dirs(root)[:-keep_last]:
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)


def find_latest(root: str | Path) -> Path | None:
    """The checkpoint `root/latest` names, else the newest complete one under `root` (or `root`
    itself if it is one); None if none. Temp dirs of interrupted saves are never returned."""
    root = Path(root)
    if STEP_DIR.match(root.name) and root.is_dir():
        return root
    dirs = dict(_step_dirs(root))
    pointer = root / LATEST
    named = STEP_DIR.match(pointer.read_text().strip()) if pointer.is_file() else None
    if named and int(named.group(1)) in dirs:  # its aside copy if killed while re-saving it
        return dirs[int(named.group(1))]
    return dirs[max(dirs)] if dirs else None


# ---------------------------------------------------------------- extra state


def write_json(path: str | Path, obj: Any) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True), encoding="utf-8")


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU and CUDA) generator states as JSON values: lists of ints,
    torch's byte states in base64, so a checkpoint stores them without a pickle."""
    py_version, py_words, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": [py_version, list(py_words), py_gauss],
        "numpy": [np_kind, np.asarray(np_keys).tolist(), np_pos, np_has_gauss, np_gauss],
        "torch": _bytes_to_text(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [_bytes_to_text(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """What `capture_rng_state` returned (also its older form: tuples, arrays and tensors, as
    loop states saved with torch.save hold it)."""
    py_version, py_words, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_words), py_gauss))
    torch.set_rng_state(_text_to_bytes(state["torch"]))
    if "numpy" in state:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_text_to_bytes(s) for s in state["cuda"]])


def _bytes_to_text(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode("ascii")


def _text_to_bytes(value: str | torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return torch.frombuffer(bytearray(base64.b64decode(value)), dtype=torch.uint8)
