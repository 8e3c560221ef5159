"""`agentrl train` on a disk that fills during a checkpoint: one error line (no traceback) with
what the save needed, what was free, the last good checkpoint and the resume command; that
checkpoint intact; and, once space is freed, `--resume` finishes the run with each step's
metrics once. The filesystem is a real tmpfs (skipped where this user may not mount)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentrl.cli import app
from agentrl.trainer import sharded_checkpoint
from agentrl.trainer.checkpoint import find_latest

FS_BYTES = 256 * 1024 * 1024
LEFT_FREE_BYTES = 64 * 1024


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "fs"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def _fill(fs: Path, left_free_bytes: int = LEFT_FREE_BYTES) -> Path:
    """Another writer takes the disk, leaving `left_free_bytes`."""
    filler = fs / "filler"
    st = os.statvfs(fs)
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize - left_free_bytes)
    return filler


def _train_args(model: str, run: Path) -> list[str]:
    return ["train", "--env", "calculator", "--model", model, "--save", str(run),
            "--num-rollout", "3", "--save-interval", "1", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8",
            "--set", "eval.eval_at_start=false", "--set", "eval.num_eval_tasks=2",
            "--set", "log.progress=false"]  # fmt: skip


def _train_lines(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/loss" in r]


@pytest.mark.slow
def test_a_disk_that_fills_during_a_save_is_one_line_and_resume_finishes(
    tiny_model_path, small_fs, monkeypatch
):
    run = small_fs / "run"
    real_save = sharded_checkpoint.save_sharded
    num_saves = []

    def save_on_a_filling_disk(out, model, optimizer, **kwargs):  # the disk fills at step 2
        num_saves.append(out)
        if len(num_saves) == 2:
            _fill(small_fs)
        real_save(out, model, optimizer, **kwargs)

    monkeypatch.setattr(sharded_checkpoint, "save_sharded", save_on_a_filling_disk)
    runner = CliRunner()
    result = runner.invoke(app, _train_args(tiny_model_path, run))
    out = result.output
    assert result.exit_code == 1, out
    assert "Traceback" not in out and isinstance(result.exception, SystemExit)
    last = [line for line in out.splitlines() if line.strip()][-1]
    step_1 = run / "checkpoints" / "step_000001"
    assert last.startswith("error: checkpoint of step 2 not saved: no space left on device"), out
    assert f"the last good checkpoint is {step_1}" in last
    assert last.endswith(f"free space, then continue with: agentrl train --resume {run}")
    assert sum("not saved" in line for line in out.splitlines()) == 1
    assert find_latest(run / "checkpoints") == step_1
    assert not any(p.name.startswith(".tmp_step_") for p in (run / "checkpoints").iterdir())
    assert [r["step"] for r in _train_lines(run)] == [1, 2]  # step 2 trained, not saved

    monkeypatch.setattr(sharded_checkpoint, "save_sharded", real_save)
    (small_fs / "filler").unlink()  # space freed
    resumed = runner.invoke(app, ["train", "--resume", str(run)])
    assert resumed.exit_code == 0, resumed.output
    assert find_latest(run / "checkpoints") == run / "checkpoints" / "step_000003"
    # Step 2 was redone after the crash: each step's line is there once.
    assert [r["step"] for r in _train_lines(run)] == [1, 2, 3]


@pytest.mark.slow
def test_a_disk_full_while_writing_rollouts_is_one_line(tiny_model_path, small_fs, monkeypatch):
    """Full before a checkpoint is due (the step's trajectories cannot be written): one line
    naming the last saved step and the resume command, no traceback."""
    import agentrl.run.state

    run = small_fs / "run"
    real_write = agentrl.run.state.write_jsonl

    def write_on_a_full_disk(path, trajectories):
        if path.endswith("step_000002.jsonl"):
            _fill(small_fs, left_free_bytes=0)
        real_write(path, trajectories)

    monkeypatch.setattr(agentrl.run.state, "write_jsonl", write_on_a_full_disk)
    result = CliRunner().invoke(app, _train_args(tiny_model_path, run))
    out = result.output
    assert result.exit_code == 1, out
    assert "Traceback" not in out and isinstance(result.exception, SystemExit)
    last = [line for line in out.splitlines() if line.strip()][-1]
    step_1 = run / "checkpoints" / "step_000001"
    assert last == (  # a failed write() names no file (an open() would)
        f"error: No space left on device; free space: the last completed step is saved in "
        f"{step_1}; continue with: agentrl train --resume {run}"
    )
