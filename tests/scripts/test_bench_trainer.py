"""scripts/bench_trainer.py on a tiny budget: it runs on a CPU, reports every backend it can
run (and why not the others), and counts FLOPs by its printed formula."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_trainer.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_trainer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_smoke_run_writes_json_and_png(tiny_model_path, tmp_path):
    out = tmp_path / "bench.json"
    results = _bench().main(["--model", tiny_model_path, "--row-tokens", "96", "--num-rows", "1",
                             "--seq-tokens", "24", "--warmup", "0", "--repeats", "1",
                             "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == results and out.with_suffix(".png").stat().st_size > 0
    rows = results["backends"]
    assert results["num_tokens"] == 96 and rows["transformers"]["ratio_to_transformers"] == 1.0
    assert rows["torch"]["tokens_per_s"] == pytest.approx(96 / rows["torch"]["step_s"])
    lora = rows["torch_lora"]  # rank 16 on all linear layers: the merged export is the full size
    assert lora["export_bytes"] == rows["torch"]["export_bytes"] > 20 * lora["adapter_bytes"] > 0
    assert lora["adapter_export_s"] > 0 and lora["tokens_per_s"] > 0
    if not torch.cuda.is_available():
        assert "--train-backend torch" in rows["megatron"]["skipped"]
        assert rows["torch"]["mfu"] is None


def test_flops_follow_the_printed_formula():
    config = SimpleNamespace(hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, intermediate_size=16, vocab_size=10)  # fmt: skip
    mb = SimpleNamespace(num_tokens=5, position_ids=torch.tensor([[0, 1, 2, 0, 1]]))
    batch = SimpleNamespace(micro_batches=lambda: [mb])
    # per layer: q 8x8, k and v 8x4 each, o 8x8, MLP 3 x 8x16 -> 64+64+64+384 = 576
    matmul_params = 2 * 576 + 10 * 8
    expected = 6 * matmul_params * 5 + 6 * 2 * 8 * (3**2 + 2**2)
    assert _bench().step_flops(config, batch) == expected
