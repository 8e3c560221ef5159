"""A full disk during a checkpoint: refused up front when the last checkpoint's size does not fit,
one line (bytes needed, bytes free, the last good checkpoint, the way on) when the disk fills
mid-save, the previous checkpoint intact, and saving works again once space is freed. The
filesystems are real: small tmpfs mounts (skipped where this user may not mount)."""

from __future__ import annotations

import asyncio
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from agentrl.config import AlgoConfig, TrainConfig
from agentrl.trainer.checkpoint import (
    CheckpointSaveError,
    find_latest,
    read_json,
    save_checkpoint,
    write_json,
)
from agentrl.trainer.checkpoint_space import save_failure, tree_bytes
from agentrl.trainer.torch_backend import TorchBackend

RESUME = "agentrl train --resume /runs/r"


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """`small_fs(size_bytes)` mounts a tmpfs of that size (or resizes the one mounted)."""
    mount = tmp_path / "fs"
    mount.mkdir()
    mounted = []

    def mount_or_resize(size_bytes: int) -> Path:
        opts = f"size={size_bytes}" if not mounted else f"remount,size={size_bytes}"
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mount)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(size_bytes)
        return mount

    yield mount_or_resize
    if mounted:
        subprocess.run(["umount", str(mount)], check=True)


def _trained(tiny_llama_path: str) -> TorchBackend:
    """A backend whose AdamW has state (its checkpoint holds the moments too)."""
    backend = TorchBackend(tiny_llama_path, TrainConfig(), AlgoConfig(), device="cpu")
    backend.setup()  # loads the model and builds the optimizer
    assert backend.optimizer is not None
    for p in backend.optimizer.param_groups[0]["params"]:
        p.grad = torch.full_like(p, 0.1)
    backend.optimizer.step()
    return backend


def _numbers(message: str) -> tuple[int, int]:
    m = re.search(r"needs ~([\d,]+) bytes, ([\d,]+) are free", message)
    assert m, message
    return int(m.group(1).replace(",", "")), int(m.group(2).replace(",", ""))


def test_a_save_that_cannot_fit_beside_the_last_is_refused_before_writing(
    tiny_llama_path, small_fs, tmp_path
):
    backend = _trained(tiny_llama_path)
    backend.save(tmp_path / "probe")
    size = tree_bytes(tmp_path / "probe")
    root = small_fs(size * 3 // 2) / "checkpoints"
    first = save_checkpoint(root, 1, backend.save, keep_last=2, resume_command=RESUME)

    with pytest.raises(CheckpointSaveError) as info:
        save_checkpoint(root, 2, backend.save, keep_last=2, resume_command=RESUME)
    message = str(info.value)
    assert "\n" not in message and message.startswith("checkpoint of step 2 not saved: not enough")
    needed, free = _numbers(message)
    assert needed == tree_bytes(first) and free < needed
    assert f"the last good checkpoint is {first}" in message and message.endswith(RESUME)
    assert find_latest(root) == first
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]


def test_the_disk_filling_mid_save_is_one_line_and_the_last_checkpoint_stays(
    tiny_llama_path, small_fs
):
    """The last checkpoint is small (nothing to warn of), the next one fills the disk inside
    torch.distributed.checkpoint: one line, not its 'unexpected pos' traceback; once the disk
    has room, the same save goes through and loads back."""
    fs = small_fs(256 * 1024)
    root = fs / "checkpoints"
    first = save_checkpoint(
        root, 1, lambda d: write_json(d / "state.json", {"step": 1}), keep_last=2
    )
    backend = _trained(tiny_llama_path)

    with pytest.raises(CheckpointSaveError) as info:
        save_checkpoint(root, 2, backend.save, keep_last=2, resume_command=RESUME)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    assert message.startswith("checkpoint of step 2 not saved: no space left on device in ")
    needed, free = _numbers(message)
    assert needed > 0 and free <= 256 * 1024
    assert f"the last good checkpoint is {first}; free space, then continue with: {RESUME}" in (
        message
    )
    assert find_latest(root) == first and read_json(first / "state.json") == {"step": 1}
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]

    small_fs(4 * 1024 * 1024)  # space freed
    second = save_checkpoint(root, 2, backend.save, keep_last=2)
    fresh = TorchBackend(tiny_llama_path, TrainConfig(), AlgoConfig(), device="cpu")
    fresh.setup()
    fresh.load(second)
    for pa, pb in zip(backend.model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(pa, pb)


class _RemoteError(Exception):
    """What a Ray actor's failure looks like on the driver: the remote text, no errno."""


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (OSError(28, "No space left on device"), "no space left on device"),
        (OSError(122, "Disk quota exceeded"), "no space left on device"),
        (
            RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
            "no space left on device",
        ),  # fmt: skip
        (
            _RemoteError(
                "ray::TrainerActor.save() ... OSError: [Errno 28] No space left on device"
            ),
            "no space left on device",
        ),  # fmt: skip
        (PermissionError(13, "Permission denied"), "Permission denied"),
    ],
)
def test_storage_failures_become_one_line_with_the_reason(tmp_path, error, reason):
    failure = save_failure(error, step=3, root=tmp_path, needed_bytes=1000, last_good=None)
    assert failure is not None
    assert str(failure).startswith(f"checkpoint of step 3 not saved: {reason} in {tmp_path}")
    assert "no earlier checkpoint was saved" in str(failure) and "\n" not in str(failure)


@pytest.mark.parametrize(
    "error", [KeyboardInterrupt(), asyncio.CancelledError(), ValueError("a bug"), KeyError("k")]
)
def test_interrupts_and_bugs_keep_their_own_error(tmp_path, error):
    assert save_failure(error, step=3, root=tmp_path, needed_bytes=0, last_good=None) is None
