"""megatron-core's multi-tensor operators on torch's own multi-tensor (foreach) kernels, where
neither Apex nor TransformerEngine supplies them.

megatron-core's local fallbacks loop over the parameters in Python. Its L2 norm (gradient
clipping, every step) reads each parameter's norm back to the host: one device sync per
parameter. Its scale, which copies the fp32 master weights into the bf16 model after every
optimizer step, launches two kernels per parameter. `install()` (at setup, through
`patches.install_all`) swaps in versions with the same signatures that launch a handful of
foreach kernels and never sync, and only where megatron-core chose its local fallback.
"""

from __future__ import annotations

from typing import Any

import agentrl.trainer.megatron.saver_compat  # noqa: F401  (before megatron.core: see there)

# isort: split
import torch
from megatron.core import utils as megatron_utils
from megatron.core.optimizer import clip_grads
from megatron.core.optimizer import optimizer as megatron_optimizer
from torch import Tensor


def multi_tensor_l2norm(
    chunk_size: int,
    noop_flag: Tensor,
    tensor_lists: list[list[Tensor]],
    per_tensor: bool,
    *args: Any,
) -> tuple[Tensor, Tensor | None]:
    """The L2 norm of all tensors of `tensor_lists[0]` together, as a 1-element fp32 tensor on
    their device (amp_C.multi_tensor_l2norm's contract, without per-tensor norms)."""
    if per_tensor:
        raise NotImplementedError("per-tensor norms are not used by megatron-core's clipping")
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch._foreach_norm(tensors)  # type: ignore[attr-defined]
    if len({n.dtype for n in norms}) > 1:
        norms = [n.float() for n in norms]
    total = torch.linalg.vector_norm(torch.stack(norms).float())
    return total.reshape(1), None


def multi_tensor_scale(
    chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]], scale: float
) -> None:
    """dst = src * scale for each pair of `tensor_lists` ([sources], [destinations]), casting to
    the destinations' dtype (scale 1.0 is megatron's fp32 master -> bf16 weights copy)."""
    sources, destinations = tensor_lists
    if not sources:
        return
    if all(s is d for s, d in zip(sources, destinations, strict=True)):  # clipping: in place
        torch._foreach_mul_(destinations, scale)  # type: ignore[attr-defined]
        return
    if scale != 1.0:  # megatron only copies (scale 1.0) between different tensors
        sources = torch._foreach_mul(sources, scale)  # type: ignore[attr-defined]
    torch._foreach_copy_(destinations, sources)  # type: ignore[attr-defined]


def install() -> list[str]:
    """Use these where megatron-core fell back to its local loops (idempotent); the attributes
    that hold them."""
    if clip_grads.l2_norm_impl is megatron_utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = multi_tensor_l2norm
    for module in (clip_grads, megatron_optimizer):
        if module.multi_tensor_scale_impl is megatron_utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = multi_tensor_scale  # type: ignore[attr-defined]
    slots = [
        (clip_grads, "l2_norm_impl"),
        (clip_grads, "multi_tensor_scale_impl"),
        (megatron_optimizer, "multi_tensor_scale_impl"),
    ]
    ours = (multi_tensor_l2norm, multi_tensor_scale)
    return [f"{m.__name__}.{name}" for m, name in slots if getattr(m, name) in ours]
