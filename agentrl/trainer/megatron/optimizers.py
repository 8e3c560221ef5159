"""The torch optimizers inside megatron-core's optimizer, for the code that reaches past it (fused
Adam, offloading, checkpoints of an optimizer that never stepped)."""

from __future__ import annotations

from typing import Any

import torch


def torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside megatron-core's (one per chained group)."""
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
