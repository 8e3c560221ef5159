"""Megatron's process groups (TP, PP, DP) over the trainer's torch.distributed ranks, and what the
last pipeline stage broadcasts to the others."""

from __future__ import annotations

import os
import socket
from typing import TypeVar, cast

import agentrl.trainer.megatron.saver_compat  # noqa: F401  (before megatron.core: see there)

# isort: split
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from torch.distributed import ProcessGroup

from agentrl.config import TrainConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel(train_cfg: TrainConfig, device: torch.device) -> None:
    """Megatron's groups over the default process group (a 1-rank one is started when the trainer
    runs in this process alone); TP ranks are neighbours, then DP, then PP (Megatron's order)."""
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=train_cfg.tensor_model_parallel_size,
            pipeline_model_parallel_size=train_cfg.pipeline_model_parallel_size,
        )
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(train_cfg.seed)


# Megatron's group getters are untyped; after `init_parallel` each returns this rank's group.
def tp_group() -> ProcessGroup:
    return cast(ProcessGroup, ps.get_tensor_model_parallel_group())


def pp_group() -> ProcessGroup:
    return cast(ProcessGroup, ps.get_pipeline_model_parallel_group())


def dp_group() -> ProcessGroup:
    return cast(ProcessGroup, ps.get_data_parallel_group())


T = TypeVar("T")


def broadcast_from_last_stage(obj: T) -> T:
    """The last pipeline stage's `obj` on every stage (metrics, logprobs)."""
    group = pp_group()
    if dist.get_world_size(group) == 1:
        return obj
    holder = [obj]
    last = dist.get_global_rank(group, dist.get_world_size(group) - 1)
    dist.broadcast_object_list(holder, src=last, group=group)
    return holder[0]
