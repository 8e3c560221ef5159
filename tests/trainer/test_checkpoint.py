"""Atomic checkpoints: latest pointer, keep-last-K, crash safety under SIGKILL, RNG state."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from agentrl.config import AlgoConfig, TrainConfig
from agentrl.trainer.checkpoint import (
    CheckpointSaveError,
    capture_rng_state,
    find_latest,
    read_json,
    restore_rng_state,
    save_checkpoint,
    write_json,
)
from agentrl.trainer.torch_backend import TorchBackend

REPO = Path(__file__).resolve().parents[2]


def _write(payload: dict):
    return lambda d: write_json(d / "state.json", payload)


def test_save_publishes_step_dirs_and_keeps_the_last_k(tmp_path):
    for step in (1, 2, 3, 4):
        path = save_checkpoint(tmp_path, step, _write({"step": step}), keep_last=2)
        assert path == tmp_path / f"step_{step:06d}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000003", "step_000004"]
    latest = find_latest(tmp_path)
    assert latest is not None and read_json(latest / "state.json") == {"step": 4}
    assert latest.name == "step_000004"
    # A checkpoint directory is its own latest.
    assert find_latest(tmp_path / "step_000003") == tmp_path / "step_000003"


def test_find_latest_without_pointer_and_ignores_temp_dirs(tmp_path):
    assert find_latest(tmp_path) is None
    assert find_latest(tmp_path / "missing") is None
    save_checkpoint(tmp_path, 5, _write({}), keep_last=3)
    (tmp_path / "latest").unlink()
    (tmp_path / ".tmp_step_000009.123").mkdir()
    assert find_latest(tmp_path) == tmp_path / "step_000005"


def test_saving_the_same_step_again_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 7, _write({"v": 1}), keep_last=2)
    save_checkpoint(tmp_path, 7, _write({"v": 2}), keep_last=2)
    assert read_json(find_latest(tmp_path) / "state.json") == {"v": 2}


def test_a_failing_writer_leaves_the_previous_checkpoint(tmp_path):
    save_checkpoint(tmp_path, 1, _write({"ok": True}), keep_last=2)

    def boom(d: Path) -> None:
        (d / "half").write_text("x")
        raise PermissionError(13, "Permission denied")

    with pytest.raises(CheckpointSaveError, match="not saved: Permission denied") as info:
        save_checkpoint(tmp_path, 2, boom, keep_last=2, resume_command="agentrl train --resume r")
    assert "\n" not in str(info.value) and "--resume r" in str(info.value)
    assert f"the last good checkpoint is {tmp_path / 'step_000001'}" in str(info.value)
    assert find_latest(tmp_path) == tmp_path / "step_000001"
    # No temp dir is left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001"]


def test_a_bug_in_the_writer_keeps_its_own_error(tmp_path):
    def bug(d: Path) -> None:
        raise KeyError("model.layers.0")

    with pytest.raises(KeyError, match="model.layers.0"):
        save_checkpoint(tmp_path, 1, bug, keep_last=2)
    assert not any(tmp_path.iterdir())


def test_a_kill_while_resaving_a_step_leaves_the_old_copy_found_and_restored(tmp_path):
    """Re-saving step_N moves the old copy aside before the new one is renamed in; killed in
    between (simulated: the state that moment leaves), the old copy is still found, and the
    next save puts it back before it writes."""
    save_checkpoint(tmp_path, 3, _write({"v": 1}), keep_last=2)
    os.rename(tmp_path / "step_000003", tmp_path / ".prev_step_000003")
    found = find_latest(tmp_path)
    assert found is not None and read_json(found / "state.json") == {"v": 1}
    assert found.name == ".prev_step_000003"
    (tmp_path / "latest").unlink()  # without the pointer, the scan finds it too
    assert find_latest(tmp_path) == found
    seen = []
    save_checkpoint(tmp_path, 4, lambda d: seen.append(find_latest(tmp_path)), keep_last=2)
    assert seen == [tmp_path / "step_000003"]  # put back before the new save began
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000003", "step_000004"]


def test_resaving_a_step_never_removes_it_before_the_new_copy_is_in(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 7, _write({"v": 1}), keep_last=2)
    real_rename = os.rename
    seen_during_publish = []

    def rename(src, dst):  # observe the directory at each rename of the publish
        real_rename(src, dst)
        seen_during_publish.append(find_latest(tmp_path) is not None)

    monkeypatch.setattr(os, "rename", rename)
    save_checkpoint(tmp_path, 7, _write({"v": 2}), keep_last=2)
    assert seen_during_publish and all(seen_during_publish)
    assert read_json(find_latest(tmp_path) / "state.json") == {"v": 2}
    assert not any(p.name.startswith(".prev_") for p in tmp_path.iterdir())


SLOW_WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from agentrl.trainer.checkpoint import save_checkpoint

    def slow(d: Path) -> None:
        (d / "model.safetensors").write_bytes(b"partial" * 1000)
        print("WRITING", flush=True)
        time.sleep(120)
        (d / "trainer_state.json").write_text("{}")

    save_checkpoint(sys.argv[1], 2, slow, keep_last=2)
    """
)


@pytest.mark.slow
def test_sigkill_while_writing_leaves_the_previous_checkpoint_loadable(tmp_path, tiny_llama_path):
    root = tmp_path / "run"
    first = TorchBackend(tiny_llama_path, TrainConfig(), AlgoConfig(), device="cpu")
    first.setup()
    save_checkpoint(root, 1, first.save, keep_last=2)

    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_WRITER, str(root)], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "WRITING"
        assert any(p.name.startswith(".tmp_step_000002") for p in root.iterdir())
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()

    latest = find_latest(root)
    assert latest == root / "step_000001"
    second = TorchBackend(tiny_llama_path, TrainConfig(), AlgoConfig(), device="cpu")
    second.setup()
    second.load(latest)
    for pa, pb in zip(first.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    # The next save cleans up the dead writer's temp dir.
    save_checkpoint(root, 2, _write({}), keep_last=2)
    assert not any(p.name.startswith(".tmp_step_") for p in root.iterdir())
    assert find_latest(root) == root / "step_000002"


def _draws() -> tuple[float, float, torch.Tensor]:
    return random.random(), float(np.random.rand()), torch.rand(3)


def test_rng_state_round_trips_through_json(tmp_path):
    """Python, numpy and torch states as plain JSON: a checkpoint stores them without a pickle."""
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    write_json(tmp_path / "rng.json", capture_rng_state())  # as a run's checkpoint holds it
    want = _draws()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng_state(read_json(tmp_path / "rng.json"))
    got = _draws()
    assert got[:2] == want[:2] and torch.equal(got[2], want[2])


def test_rng_state_of_an_older_checkpoint_still_restores():
    """Loop states saved by torch.save held tuples, a numpy array and a tensor."""
    random.seed(2)
    np.random.seed(2)
    torch.manual_seed(2)
    old = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    want = _draws()
    restore_rng_state(old)
    got = _draws()
    assert got[:2] == want[:2] and torch.equal(got[2], want[2])


def test_a_save_before_the_first_update_changes_no_later_step(
    tiny_llama_path, groups_factory, tmp_path
):
    """Saving (and resuming from) a checkpoint taken before the optimizer ever stepped gives the
    same weights, bit for bit, as never saving: the save creates no AdamW state (whose `step`
    of 1 would shrink the first real update), and the load leaves the optimizer fresh."""
    from agentrl.trainer.batch import build_train_batches

    groups = groups_factory(num_groups=2, group_size=4, seed=3)
    kw = dict(lr=1e-2, weight_decay=0.1, num_rollout=4)

    def backend() -> TorchBackend:
        b = TorchBackend(tiny_llama_path, TrainConfig(**kw), AlgoConfig(), device="cpu")
        b.setup()
        return b

    def two_steps(b: TorchBackend) -> list[torch.Tensor]:
        for _ in range(2):
            b.train_step(
                build_train_batches(groups, AlgoConfig(), max_tokens_per_micro_batch=64, pad_id=0)[
                    0
                ]
            )
        return [p.detach().clone() for p in b.model.parameters()]

    clean = two_steps(backend())
    saved = backend()
    saved.save(tmp_path / "step0")
    resumed = backend()
    resumed.load(tmp_path / "step0")
    for weights in (two_steps(saved), two_steps(resumed)):
        assert all(torch.equal(a, b) for a, b in zip(clean, weights, strict=True))
    # A checkpoint with state, loaded into an optimizer that has stepped, replaces that state;
    # one without state makes a used optimizer fresh again.
    resumed.load(tmp_path / "step0")
    assert resumed.optimizer is not None and not resumed.optimizer.state
