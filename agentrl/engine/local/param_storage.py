"""Dropping and re-allocating a model's parameter storage, for a colocated release that keeps
no host copy (SGLang's default): the trainer sends every weight again before the next request,
so copying them out and back in would only cost time."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    """Fresh, uninitialised storage of the old shapes; `unsent` tracks what no update wrote yet."""
    for param, shape in dropped.params:
        param.data = torch.empty(shape, dtype=param.dtype, device=device)
    dropped.unsent = {param.data_ptr() for param, _ in dropped.params}


def mark_written(dropped: DroppedParameters | None, tensor: torch.Tensor) -> None:
    if dropped is not None:
        dropped.unsent.discard(tensor.data_ptr())
