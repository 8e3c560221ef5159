"""Weight export: a model's HF-named tensors, gathered whole from their shards one at a time (the
trainer's exporters cut them into buckets with `buckets.py`)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor  # what FSDP2 leaves in place of each parameter


def full_tensor(tensor: Tensor) -> Tensor:
    """The whole tensor: gathered from every rank if it is a sharded DTensor (collective), the
    local tensor of a one-rank DTensor (no dispatch: ~30 us a tensor), else itself."""
    if not isinstance(tensor, DTensor):
        return tensor
    return tensor.to_local() if tensor.device_mesh.size() == 1 else tensor.full_tensor()


def unique_named_tensors(
    model: torch.nn.Module, *, gather_dtype: torch.dtype | None = None
) -> Iterator[tuple[str, Tensor]]:
    """(HF name, whole tensor) of each parameter and persistent buffer, each object once: a tied
    lm_head is left out, as save_pretrained does. Gathers lazily, in state_dict order, so every
    rank must iterate to the end together and at most one gathered tensor is alive per step.
    `gather_dtype`: floats that must be gathered are cast to it first (fewer bytes on the wire);
    others come in their own dtype (the bucket packer casts them in its copy)."""
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        tensor = tensor.detach()
        if gather_dtype is not None and tensor.is_floating_point() and _is_sharded(tensor):
            tensor = tensor.to(gather_dtype)
        yield name, full_tensor(tensor)


def _is_sharded(tensor: Tensor) -> bool:
    return isinstance(tensor, DTensor) and tensor.device_mesh.size() > 1
