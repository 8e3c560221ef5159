"""LoRA on the Megatron backend: adapters of our own beside megatron-core's tensor-parallel linears
(Megatron-Bridge's PEFT needs TransformerEngine and CUDA to install), their merged weights and
their PEFT-named export (what the torch backend's `trainer/lora.py` gives), and the switch that
turns them off for the KL reference."""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import agentrl.trainer.megatron.saver_compat  # noqa: F401  (before megatron.core: see there)

# isort: split
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from torch import Tensor

from agentrl.config import ConfigError, TrainConfig
from agentrl.trainer.lora import (
    ALL_LINEAR,
    MEGATRON_NAMES,
    AdapterExport,
    _json_value,
    make_lora_config,
)
from agentrl.trainer.megatron.parallel import tp_group
from agentrl.trainer.megatron.weight_map import WeightMap, to_global_name

LORA_SUFFIX = "_lora"
"""An adapted linear `x.linear_qkv` gets its adapter as the sibling module `x.linear_qkv_lora`: the
base's parameter names (and so the HF weight map and its checkpoints) stay as they are."""
_ROW_PARALLEL = ("linear_proj", "linear_fc2")  # their input is split over TP ranks


def is_lora_name(name: str) -> bool:
    return f"{LORA_SUFFIX}." in name


def check_lora_fit(cfg: TrainConfig) -> None:
    """What the Megatron backend's LoRA does not cover yet, refused before anything loads."""
    if not cfg.lora_rank:
        return
    if cfg.pipeline_model_parallel_size > 1:
        raise ConfigError(
            f"--lora-rank with --pipeline-model-parallel-size={cfg.pipeline_model_parallel_size} "
            "is not supported on --train-backend megatron yet; use tensor or data parallelism"
        )
    if cfg.sequence_parallel:
        raise ConfigError(
            "--lora-rank with --sequence-parallel is not supported on --train-backend megatron "
            "yet; drop --sequence-parallel"
        )
    megatron_targets(cfg.lora_target_modules)


def megatron_targets(names: list[str]) -> list[str]:
    """`train.lora_target_modules` (HF or Megatron names) -> the Megatron linears to adapt. A
    fused linear takes one adapter for all the HF projections it holds, so it needs all of them."""
    if names == [ALL_LINEAR]:
        return list(MEGATRON_NAMES)
    targets = []
    for megatron_name, hf_names in MEGATRON_NAMES.items():
        named = [n for n in hf_names if n in names]
        if megatron_name in names or len(named) == len(hf_names):
            targets.append(megatron_name)
        elif named:
            raise ConfigError(
                f"--lora-target-modules names {','.join(named)} without the rest of "
                f"{','.join(hf_names)}, which Megatron fuses into {megatron_name}; name all of "
                "them (or all-linear), or use --train-backend torch"
            )
    known = {n for hf in MEGATRON_NAMES.values() for n in hf} | set(MEGATRON_NAMES)
    if unknown := [n for n in names if n not in known]:
        raise ConfigError(
            f"--lora-target-modules names {unknown[0]!r}, which the Megatron backend cannot "
            f"adapt; use all-linear or some of {','.join(sorted(known))}"
        )
    return targets


class LoraBranch(torch.nn.Module):
    """The adapter beside one tensor-parallel linear: adds scaling * B @ A x to its output.

    The products Megatron-Bridge's adapters compute: beside a column-parallel linear A [r, in] is
    whole on every TP rank (Megatron-Bridge splits it over r and gathers; at rank r it is small)
    and B [out/tp, r] holds this rank's output rows; the gradient reaching A is summed over TP
    first, so A's gradient is the whole one everywhere. Beside a row-parallel linear A [r, in/tp]
    takes this rank's input columns, the product is summed over TP, and B [out, r] is whole."""

    def __init__(self, a: Tensor, b: Tensor, *, is_row: bool, scaling: float, dropout: float):
        super().__init__()
        self.lora_A = torch.nn.Parameter(a)
        self.lora_B = torch.nn.Parameter(b)
        self.is_row = is_row
        self.scaling = scaling
        self.dropout = dropout
        self.is_enabled = True
        sharded = self.lora_A if is_row else self.lora_B
        set_tensor_model_parallel_attributes(sharded, True, 1 if is_row else 0, 1)

    def delta(self, x: Tensor) -> Tensor:
        x = F.dropout(x, self.dropout, training=self.training)
        u = F.linear(x, self.lora_A)  # [..., r]
        group = tp_group()
        if self.is_row:
            u = reduce_from_tensor_model_parallel_region(u, group)
        else:  # backward: the gradient reaching A (and x) summed over TP
            u = copy_to_tensor_model_parallel_region(u, group)
        return F.linear(u, self.lora_B) * self.scaling

    def add_to(self, module: Any, args: tuple, output: tuple) -> tuple | None:
        """Forward hook of the base linear (which returns (output, bias))."""
        if not self.is_enabled:
            return None
        out, bias = output
        return out + self.delta(args[0]).to(out.dtype), bias

    def merged(self, weight: Tensor) -> Tensor:
        """The base's weight shard with this adapter merged in (float32 sums, as PEFT merges)."""
        delta = self.lora_B.detach().float() @ self.lora_A.detach().float()
        return (weight.detach().float() + self.scaling * delta).to(weight.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """For dist_checkpointing, sharded over TP as the base it sits beside (fused gate/up rows
        per rank as megatron-core saves linear_fc1)."""
        state = self.state_dict(prefix="", keep_vars=True)
        axis = {"lora_A": 1} if self.is_row else {"lora_B": 0}
        out = make_sharded_tensors_for_checkpoint(
            state,
            prefix,
            axis,
            sharded_offsets,
            tp_group=tp_group(),
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )
        if prefix.endswith(f"linear_fc1{LORA_SUFFIX}."):
            key = f"{prefix}lora_B"
            out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets)
        return out


def add_lora(stage: torch.nn.Module, cfg: TrainConfig, wmap: WeightMap) -> dict[str, LoraBranch]:
    """Freeze `stage` and put adapters beside its targeted linears; returns them by global linear
    name (`decoder.layers.0.self_attention.linear_qkv`). A is drawn whole from the seed and the
    linear's name (so any TP size draws the same), kaiming-uniform as PEFT draws it; B is 0."""
    stage.requires_grad_(False)
    targets = megatron_targets(cfg.lora_target_modules)
    branches = {}
    for name, module in list(stage.named_modules()):
        parent_name, _, leaf = name.rpartition(".")
        if leaf not in targets:
            continue
        global_name = to_global_name(name, 0)
        weight = cast(Tensor, module.weight)
        branch = _make_branch(weight, global_name, cfg, wmap, is_row=leaf in _ROW_PARALLEL)
        stage.get_submodule(parent_name).add_module(f"{leaf}{LORA_SUFFIX}", branch)
        module.register_forward_hook(branch.add_to)
        branches[global_name] = branch
    return branches


def _make_branch(
    weight: Tensor, name: str, cfg: TrainConfig, wmap: WeightMap, *, is_row: bool
) -> LoraBranch:
    rank = cfg.lora_rank
    tp_rank = ps.get_tensor_model_parallel_rank()
    fan_in = weight.shape[1] * (wmap.tp_size if is_row else 1)
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)), PEFT's (and torch's) init
    a = torch.empty(rank, fan_in).uniform_(-bound, bound, generator=g)
    if is_row:
        a = wmap.split_tp(f"{name}.weight", a)[tp_rank]
    b = torch.zeros(weight.shape[0], rank)
    # contiguous: a column slice of the whole A is a strided view, which the fused Adam step
    # (and the DDP buffers) would read as if it were packed
    a, b = (t.to(weight.device, weight.dtype).contiguous() for t in (a, b))
    return LoraBranch(a, b, is_row=is_row, scaling=cfg.lora_alpha / rank, dropout=cfg.lora_dropout)


@contextmanager
def adapters_off(branches: dict[str, LoraBranch]) -> Iterator[None]:
    """The base model alone for a while: the KL reference, without a second copy."""
    for branch in branches.values():
        branch.is_enabled = False
    try:
        yield
    finally:
        for branch in branches.values():
            branch.is_enabled = True


def merge_fn(branches: dict[str, LoraBranch]):
    """For `export_hf_tensors`: a base weight shard -> that shard of the merged weight."""

    def merge(name: str, tensor: Tensor) -> Tensor:
        branch = branches.get(name.removesuffix(".weight"))
        return branch.merged(tensor) if branch is not None and name.endswith(".weight") else tensor

    return merge


def _whole(tensor: Tensor, name: str, wmap: WeightMap, is_sharded: bool) -> Tensor:
    """A TP-sharded adapter matrix gathered, laid out as the base weight `name` is."""
    if not is_sharded or wmap.tp_size == 1:
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(wmap.tp_size)]
    dist.all_gather(shards, tensor.contiguous(), group=tp_group())
    return wmap.merge_tp(name, shards)


@torch.no_grad()
def export_adapter(
    branches: dict[str, LoraBranch],
    wmap: WeightMap,
    cfg: TrainConfig,
    *,
    base_model_path: str,
    dtype: torch.dtype | None = None,
) -> AdapterExport:
    """The adapter under PEFT's names for the HF model (collective over TP). A fused linear's B
    splits by output rows into its projections' Bs (q/k/v, gate/up); their shared A is repeated
    for each, which PEFT's per-module adapters need and which gives the same B @ A products."""
    tensors: list[tuple[str, Tensor]] = []
    for name, branch in branches.items():
        weight_name = f"{name}.weight"
        a = _whole(branch.lora_A.detach(), weight_name, wmap, branch.is_row)
        b = _whole(branch.lora_B.detach(), weight_name, wmap, not branch.is_row)
        for hf_name, b_part in wmap.to_hf(weight_name, b):
            module = f"base_model.model.{hf_name.removesuffix('.weight')}"
            tensors.append((f"{module}.lora_A.weight", a))
            tensors.append((f"{module}.lora_B.weight", b_part.contiguous()))
    if dtype is not None:
        tensors = [(n, t.to(dtype)) for n, t in tensors]
    modules = sorted({n.split(".")[-3] for n, _ in tensors})
    return AdapterExport(tensors, adapter_config_dict(cfg, modules, base_model_path))


def adapter_numel(branches: dict[str, LoraBranch], wmap: WeightMap) -> int:
    """Elements of `export_adapter`'s tensors (A repeated per projection), without collectives."""
    total = 0
    for name, branch in branches.items():
        num_parts = len(wmap.hf_names(f"{name}.weight"))
        a = branch.lora_A.numel()
        b = branch.lora_B.numel()
        total += num_parts * a * (wmap.tp_size if branch.is_row else 1)
        total += b * (1 if branch.is_row else wmap.tp_size)
    return total


def adapter_config_dict(
    cfg: TrainConfig, target_modules: list[str], base_model_path: str
) -> dict[str, Any]:
    """The `adapter_config.json` PEFT would write for these adapters (as the torch backend's)."""
    config = make_lora_config(cfg).to_dict()
    config.update(
        target_modules=target_modules, base_model_name_or_path=base_model_path, inference_mode=True
    )
    return json.loads(json.dumps(config, default=_json_value))
