"""The embedded engine's LoRA adapter (`MergedAdapter`): merged into the weights in place from the
base, exactly cast(W_base + alpha/r * B @ A) in float32; a later adapter replaces it (a weight it
no longer touches gets its base back bit for bit); unload gives the base back; a bad adapter is a
one-line error before anything is written."""

from __future__ import annotations

import asyncio

import pytest
import torch

from agentrl.engine.local import LocalEngine
from agentrl.weights.adapter import PEFT_PREFIX, AdapterExport

Q = "model.layers.0.self_attn.q_proj"
K = "model.layers.0.self_attn.k_proj"


def _adapter(weights: dict[str, torch.Tensor], modules: list[str], seed: int) -> AdapterExport:
    g = torch.Generator().manual_seed(seed)
    named = []
    for module in modules:
        out_dim, in_dim = weights[f"{module}.weight"].shape
        named.append((f"{PEFT_PREFIX}{module}.lora_A.weight", torch.randn(4, in_dim, generator=g)))
        named.append((f"{PEFT_PREFIX}{module}.lora_B.weight", torch.randn(out_dim, 4, generator=g)))
    return AdapterExport(named, {"r": 4, "lora_alpha": 8})


def _merged(base: torch.Tensor, adapter: AdapterExport, module: str) -> torch.Tensor:
    a, b = adapter.pairs()[f"{module}.weight"]
    return (base.float() + 2.0 * (b.float() @ a.float())).to(base.dtype)


@pytest.mark.parametrize("fuse", [False, True])
def test_adapters_merge_replace_and_unload_exactly(tiny_model_path, fuse) -> None:
    async def run() -> None:
        engine = LocalEngine.load(tiny_model_path, device="cpu", fuse_projections=fuse)
        weights = engine.model.state_dict()
        base = {n: t.clone() for n, t in weights.items()}
        first = _adapter(weights, [Q, K], seed=0)
        await engine.load_lora_adapter("a1", first, weight_version=1)
        assert torch.equal(weights[f"{Q}.weight"], _merged(base[f"{Q}.weight"], first, Q))
        assert engine.weight_version == 1 and engine.adapter.name == "a1"
        if fuse:  # the fused q/k/v weight reads the merged projections
            layer = engine.fused.layers[0]  # type: ignore[union-attr]
            assert layer.qkv.weight is not None
            assert torch.equal(
                layer.qkv.weight[: base[f"{Q}.weight"].shape[0]], weights[f"{Q}.weight"]
            )
        second = _adapter(weights, [K], seed=1)
        await engine.load_lora_adapter("a2", second, weight_version=2)
        assert torch.equal(weights[f"{Q}.weight"], base[f"{Q}.weight"])  # no longer adapted
        assert torch.equal(weights[f"{K}.weight"], _merged(base[f"{K}.weight"], second, K))
        await engine.unload_lora_adapter("a1")  # replaced already: nothing to do
        assert engine.adapter.name == "a2"
        await engine.unload_lora_adapter("a2")
        for name, tensor in base.items():
            assert torch.equal(weights[name], tensor), name
        await engine.close()

    asyncio.run(run())


def test_an_adapter_that_does_not_fit_the_model_is_refused_in_one_line(tiny_model_path) -> None:
    async def run() -> None:
        engine = LocalEngine.load(tiny_model_path, device="cpu")
        weights = engine.model.state_dict()
        before = weights[f"{Q}.weight"].clone()
        adapter = _adapter(weights, [Q], seed=0)
        wrong_name = AdapterExport(
            [(n.replace("layers.0", "layers.9"), t) for n, t in adapter.named_tensors],
            adapter.config_dict,
        )
        with pytest.raises(ValueError, match=r"layers\.9.*is not a weight of this model"):
            await engine.load_lora_adapter("x", wrong_name, weight_version=1)
        wrong_rank = AdapterExport(adapter.named_tensors, {"r": 8, "lora_alpha": 8})
        with pytest.raises(ValueError, match=r"needs lora_A \[r=8, in\]"):
            await engine.load_lora_adapter("x", wrong_rank, weight_version=1)
        unnamed = AdapterExport([("q.weight", torch.zeros(1))], adapter.config_dict)
        with pytest.raises(ValueError, match="not named as PEFT saves LoRA"):
            await engine.load_lora_adapter("x", unnamed, weight_version=1)
        rslora = AdapterExport(adapter.named_tensors, {"r": 4, "lora_alpha": 8, "use_rslora": True})
        with pytest.raises(ValueError, match="use_rslora=true"):
            await engine.load_lora_adapter("x", rslora, weight_version=1)
        assert torch.equal(weights[f"{Q}.weight"], before) and engine.adapter.name is None
        await engine.close()

    asyncio.run(run())
