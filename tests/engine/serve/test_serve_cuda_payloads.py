"""CUDA-IPC weight payloads (agentrl's and SGLang's device-UUID form) pass the receiver's
allow-list bit-exact between two processes; a UUID no GPU here has is refused
(`cuda_ipc_payloads.py` does the work, and runs alone on a GPU machine without agentrl's deps)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.gpu
def test_cuda_ipc_payloads_rebuild_bit_exact() -> None:
    script = Path(__file__).with_name("cuda_ipc_payloads.py")
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout + done.stderr
