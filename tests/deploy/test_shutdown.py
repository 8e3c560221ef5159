"""SIGTERM (a scheduler's preemption) in the middle of a Ray run: the last completed step is
saved, the command exits 130 with the resume command, and no actor or server is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return max((r["step"] for r in rows if "train/loss" in r), default=0)


def test_sigterm_saves_the_last_step_and_stops_every_process(tiny_model_path, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "agentrl.cli", "train", "--env", "calculator",
           "--model", tiny_model_path, "--save", str(run_dir), "--num-rollout", "50",
           "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
           "--rollout-max-response-len", "8", "--save-interval", "100",
           "--colocate", "--actor-num-gpus-per-node", "2",
           "--set", "eval.eval_at_start=false", "--set", "log.progress=false",
           "--set", "log.use_tensorboard=false"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while _steps_done(run_dir) < 1:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "no train step within 240 s"
            time.sleep(0.5)
        workers = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        assert len(workers) >= 4  # Ray's own, two trainer ranks, two engine servers
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output
    assert f"agentrl train --resume {run_dir}" in output.replace("\n", "")
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert saved and int(saved[-1].split("_")[1]) >= 1  # the last completed step, not step 50
    time.sleep(2)
    left = [
        pid
        for pid in workers
        if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
    ]
    assert not left, [psutil.Process(p).cmdline()[:3] for p in left]
    assert os.path.exists(run_dir / "checkpoints" / "latest")
