"""Weight-gradient accumulation into megatron's fp32 buffers without Apex (wgrad.py): off on the
CPU, and on CUDA the same sums as fp32 arithmetic."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (pip install 'agentrl[megatron]')"
)

from agentrl.trainer.megatron import wgrad


def test_cpu_is_refused_even_where_the_extension_is_available(monkeypatch):
    from megatron.core.tensor_parallel import layers

    assert wgrad.install(torch.device("cpu")) is False
    assert (
        getattr(layers, "fused_weight_gradient_mlp_cuda", None) is not wgrad.TorchWgradAccumulation
    )
    # Apex installed (or a CUDA install earlier in the process): still no answer for the CPU.
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", True, raising=False)
    assert wgrad.install(torch.device("cpu")) is False


def test_same_dtype_accumulates_in_place():
    """fp32 weights (or half-precision buffers): a plain in-place addmm over every token dim."""
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(3, 5, 8, generator=g), torch.randn(3, 5, 4, generator=g)  # [S, B, H]
    buffer = torch.randn(4, 8, generator=g)
    want = buffer + dy.reshape(-1, 4).t() @ x.reshape(-1, 8)
    wgrad.TorchWgradAccumulation.wgrad_gemm_accum_fp32(x, dy, buffer)
    torch.testing.assert_close(buffer, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_accumulates_bf16_products_in_fp32():
    from megatron.core.tensor_parallel import layers

    assert wgrad.install(torch.device("cuda")) is True
    assert layers._grad_accum_fusion_available is True
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(128 + 32 * 64, generator=g).cuda()  # megatron hands out views of one buffer
    buffer = flat[128:].view(32, 64)
    want = buffer.clone()
    for _ in range(3):  # three micro-batches into one buffer
        x = torch.randn(256, 2, 64, generator=g).cuda().bfloat16()
        dy = torch.randn(256, 2, 32, generator=g).cuda().bfloat16()
        layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x, dy, buffer)
        want += dy.reshape(-1, 32).float().t() @ x.reshape(-1, 64).float()
    torch.testing.assert_close(buffer, want, rtol=1e-4, atol=1e-3)
    assert buffer.data_ptr() == flat[128:].data_ptr()  # in place, in the shared buffer
