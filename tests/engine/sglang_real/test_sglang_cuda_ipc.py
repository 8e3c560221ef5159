"""Issue 26 on a GPU: the CUDA-IPC payload agentrl's trainer builds (one serialization per TP
rank) is rebuilt bit-exact by SGLang's own deserializer and `FlattenedTensorBucket`, on CUDA, in
another process, with and without sglang importable in the trainer (`cuda_ipc_sglang.py`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.gpu
def test_sglang_rebuilds_agentrl_cuda_ipc_payload_bit_exact() -> None:
    script = Path(__file__).with_name("cuda_ipc_sglang.py")
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout + done.stderr
