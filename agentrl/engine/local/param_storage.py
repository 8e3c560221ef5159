"""Dropping and re-allocating a model's parameter storage, for a colocated release that keeps
no host copy (SGLang's default): the trainer sends every weight again before the next request,
so copying them out and back in would only cost time."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

_ALIGN_BYTES = 256


@dataclass
class DroppedParameters:
    """The parameters whose storage was freed, with what they need to be allocated again."""

    params: list[tuple[torch.nn.Parameter, torch.Size]]
    unsent: set[int] = field(default_factory=set)  # data_ptrs allocated but not yet written


def drop_parameters(model: torch.nn.Module) -> DroppedParameters:
    """Free every parameter's storage (tied parameters once); buffers stay, they are small and
    not sent by the trainer (rotary frequencies)."""
    dropped = []
    for param in model.parameters():  # unique Parameter objects: a tied head appears once
        dropped.append((param, param.shape))
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    return DroppedParameters(dropped)


def reallocate_parameters(dropped: DroppedParameters, device: str | torch.device) -> None:
    """Fresh, uninitialised storage of the old shapes: one allocation per dtype, each parameter a
    view of it at a 256-byte aligned offset (once the cache was emptied, a cudaMalloc per tensor
    costs ~0.5 ms: 0.13 s for a 1.7B model's 218 tensors against a few ms for one block).
    `unsent` tracks what no update wrote yet."""
    by_dtype: dict[torch.dtype, list[tuple[torch.nn.Parameter, torch.Size]]] = {}
    for param, shape in dropped.params:
        by_dtype.setdefault(param.dtype, []).append((param, shape))
    for dtype, params in by_dtype.items():
        align = max(1, _ALIGN_BYTES // dtype.itemsize)
        starts, total = [], 0
        for _, shape in params:  # every view at least `align` long: distinct data_ptrs
            starts.append(total)
            total += -(-max(1, math.prod(shape)) // align) * align
        block = torch.empty(total, dtype=dtype, device=device)
        for (param, shape), start in zip(params, starts, strict=True):
            param.data = block[start : start + math.prod(shape)].view(shape)
    dropped.unsent = {param.data_ptr() for param, _ in dropped.params}


def mark_written(dropped: DroppedParameters | None, tensor: torch.Tensor) -> None:
    if dropped is not None:
        dropped.unsent.discard(tensor.data_ptr())
