"""scripts/bench_rope.py on a tiny budget: both RoPE paths measured on the same tensors, agentrl's
bit-identical to megatron-core's and with fewer operators per call."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

# agentrl's module first: it imports megatron-core past a memory saver a test initialised.
pytest.importorskip("agentrl.trainer.megatron.rope")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_rope.py"


def test_smoke_run_writes_json_and_png(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_rope", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rope.json"
    record = bench.main(["--sequences", "4", "--tokens", "64", "--heads", "2", "--dim", "8",
                         "--repeats", "2", "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == record and out.with_suffix(".png").stat().st_size > 0
    assert record["bit_identical"] is True
    theirs, ours = record["results"]
    assert ours["aten_ops_per_call"] < theirs["aten_ops_per_call"]
