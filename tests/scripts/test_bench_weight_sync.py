"""scripts/bench_weight_sync.py's LoRA table: each adapter-only row against the full fine-tuning
row of its layout, in megabytes, percent of the full sync and seconds per sync."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_weight_sync.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_weight_sync", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_lora_table_compares_each_adapter_row_with_its_layouts_full_sync(capsys):
    row = dict(layout="colocated", num_engines=1, bucket_mib=512)
    full = {**row, "lora_rank": 0, "bytes": 2e9, "seconds": [0.5, 0.4]}
    lora = {**row, "lora_rank": 16, "bytes": 2.2e7, "seconds": [0.03, 0.02]}
    _bench().print_lora([full, lora])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.split() == [
        "colocated",
        "LoRA",
        "r16",
        "x1",
        "(512",
        "MiB)",
        "22.00",
        "1.10%",
        "0.0200",
        "0.4000",
    ]
