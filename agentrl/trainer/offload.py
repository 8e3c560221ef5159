"""Optimizer state in host memory between steps (slime's --offload-train): what a trainer
sharing its GPU with an engine gives back, so the engine's KV cache can take that room."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


class StateOffload:
    """The optimizer state tensors moved to pinned host memory, and where to put them back."""

    def __init__(self) -> None:
        self._moved: list[tuple[dict[str, Tensor], str, torch.device]] = []

    def __bool__(self) -> bool:
        return bool(self._moved)

    def offload(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Every CUDA tensor of the optimizers' state (AdamW's moments, a fused step counter) to
        pinned host memory; their device blocks go back to the driver. Empty state (no step yet)
        moves nothing. Twice in a row moves nothing the second time."""
        if self._moved:
            return
        for optimizer in optimizers:
            for entry in optimizer.state.values():
                for key, value in entry.items():
                    if isinstance(value, Tensor) and value.device.type == "cuda":
                        entry[key] = value.to("cpu", non_blocking=True)  # lands in pinned memory
                        self._moved.append((entry, key, value.device))
        if self._moved:
            torch.cuda.synchronize()  # the host copies are whole before the blocks are reused
            torch.cuda.empty_cache()

    def reload(self) -> None:
        """Each moved tensor back to the device it came from."""
        for entry, key, device in self._moved:
            entry[key] = entry[key].to(device, non_blocking=True)
        self._moved = []

    def forget(self) -> None:
        """The state was replaced (a checkpoint loaded): nothing to move back."""
        self._moved = []
