"""Weight gradients accumulated straight into megatron's fp32 gradient buffers, without Apex.

Megatron's linear layers compute each micro-batch's weight gradient in bf16 and its DDP adds it
to the parameter's fp32 `main_grad` afterwards: one more read and write of every weight's
gradient per micro-batch (on a 1.7B model, four micro-batches: 584 fp32 adds, 26 ms of a
0.5 s step on an H200), and the rounding of a bf16 partial sum. With
`gradient_accumulation_fusion` the GEMM itself accumulates into `main_grad`, through Apex's
`fused_weight_gradient_mlp_cuda` extension, which is not installed here. torch's `addmm` with
`out_dtype=float32` does the same (bf16 operands, fp32 output in place: cuBLAS with beta=1), so
`install()` hands megatron that, on CUDA, when this torch has it and it gives the right sum.
"""

from __future__ import annotations

import logging

import agentrl.trainer.megatron.saver_compat  # noqa: F401  (before megatron.core: see there)

# isort: split
import torch
from megatron.core.tensor_parallel import layers as megatron_layers
from torch import Tensor

logger = logging.getLogger(__name__)


def _accumulate(total_input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    x = total_input.reshape(-1, total_input.shape[-1])
    g = grad_output.reshape(-1, grad_output.shape[-1])
    if x.dtype == main_grad.dtype:  # fp32 weights, or half-precision gradient buffers
        main_grad.addmm_(g.t(), x)
    else:  # half-precision operands, fp32 sums
        torch.addmm(main_grad, g.t(), x, out_dtype=main_grad.dtype, out=main_grad)


class TorchWgradAccumulation:
    """Apex's `fused_weight_gradient_mlp_cuda` contract: main_grad += grad_output^T @ input,
    over every leading (token) dimension, for fp32 and half-precision `main_grad` alike."""

    wgrad_gemm_accum_fp32 = wgrad_gemm_accum_fp16 = staticmethod(_accumulate)


def _accumulates_in_place(device: torch.device) -> bool:
    """Whether `addmm(out_dtype=float32, out=main_grad)` exists here and adds in place, into a
    view of a larger buffer as megatron's gradient buffers hand out."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(64, 48, generator=g).to(device, torch.bfloat16)
    dy = torch.randn(64, 32, generator=g).to(device, torch.bfloat16)
    flat = torch.randn(64 + 32 * 48, generator=g).to(device)
    acc = flat[64:].view(32, 48)
    want = acc + dy.float().t() @ x.float()
    try:
        TorchWgradAccumulation.wgrad_gemm_accum_fp32(x, dy, acc)
    except (RuntimeError, TypeError) as exc:  # an older torch: no out_dtype, or not on this GPU
        logger.info("no fused weight-gradient accumulation (%s)", str(exc).splitlines()[0])
        return False
    return bool(torch.allclose(acc, want, rtol=1e-3, atol=1e-3))


def install(device: torch.device) -> bool:
    """Give megatron-core the accumulation above where Apex's is missing; whether
    `gradient_accumulation_fusion` can be turned on for a model on `device`."""
    if device.type != "cuda":
        return False
    if getattr(megatron_layers, "_grad_accum_fusion_available", False):
        return True  # Apex's own extension is installed, or this ran before
    if not _accumulates_in_place(device):
        return False
    megatron_layers.fused_weight_gradient_mlp_cuda = TorchWgradAccumulation  # type: ignore[attr-defined]
    megatron_layers._grad_accum_fusion_available = True
    return True


def is_installed() -> bool:
    """Whether megatron-core accumulates weight gradients through this module (not Apex's)."""
    return (
        getattr(megatron_layers, "fused_weight_gradient_mlp_cuda", None) is TorchWgradAccumulation
    )
