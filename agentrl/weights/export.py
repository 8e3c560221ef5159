"""Weight export: a model's HF-named tensors, gathered whole from their shards one at a time (the
trainer's exporters cut them into buckets with `buckets.py`)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor  # what FSDP2 leaves in place of each parameter


def full_tensor(tensor: Tensor) -> Tensor:
    """The whole tensor: gathered from every rank if it is a DTensor (collective), else itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def unique_named_tensors(
    model: torch.nn.Module, *, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, Tensor]]:
    """(HF name, whole tensor) of each parameter and persistent buffer, each object once: a tied
    lm_head is left out, as save_pretrained does. Gathers lazily, in state_dict order, so every
    rank must iterate to the end together and at most one gathered tensor is alive per step."""
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)  # before the gather: fewer bytes on the wire
        yield name, full_tensor(tensor)
