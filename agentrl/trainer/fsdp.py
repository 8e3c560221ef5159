"""Data parallelism for the torch backend: FSDP2 (`fully_shard`) over every rank of the default
torch.distributed group (`step.reduce_metrics` makes every rank report the same numbers)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def dp_world_size() -> int:
    """Ranks of the default process group; 1 without one."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers model (its `_no_split_modules` classes)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} declares no decoder layer classes (_no_split_modules="
            f"{sorted(names)}), so FSDP cannot shard it layer by layer; train it on one rank"
        )
    return layers


def apply_fsdp(root: torch.nn.Module, layers: list[torch.nn.Module], device: torch.device) -> None:
    """Shard each layer, then the root (embedding, final norm, head) over a 1-D mesh of all ranks.

    Gradients are summed over ranks, not averaged: each rank's loss is already divided by the
    global denominators of `build_train_batches`, so the sum is the 1-rank gradient."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(device.type, (dp_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(root, mesh=mesh)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM (no NCCL PreMulSum), which gloo runs too.
            module.set_force_sum_reduction_for_comms(True)
