"""Atomic checkpoints: latest pointer, keep-last-K, crash safety under SIGKILL, RNG state."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from agentrl.config import AlgoConfig, TrainConfig
from agentrl.trainer.checkpoint import (
    checkpoint_step,
    find_latest,
    load_rng_state,
    read_json,
    save_checkpoint,
    save_rng_state,
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
    assert checkpoint_step(latest) == 4
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
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, boom, keep_last=2)
    assert find_latest(tmp_path) == tmp_path / "step_000001"
    # No temp dir is left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001"]


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
    second.load(latest)
    for pa, pb in zip(first.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    # The next save cleans up the dead writer's temp dir.
    save_checkpoint(root, 2, _write({}), keep_last=2)
    assert not any(p.name.startswith(".tmp_step_") for p in root.iterdir())
    assert find_latest(root) == root / "step_000002"


def test_rng_state_round_trip(tmp_path):
    random.seed(1)
    torch.manual_seed(1)
    save_rng_state(tmp_path / "rng.pt")
    want = (random.random(), torch.rand(3))
    random.seed(99)
    torch.manual_seed(99)
    load_rng_state(tmp_path / "rng.pt")
    got = (random.random(), torch.rand(3))
    assert got[0] == want[0] and torch.equal(got[1], want[1])


def test_keep_last_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep_last=0"):
        save_checkpoint(tmp_path, 1, _write({}), keep_last=0)
    assert not any(tmp_path.iterdir())
