"""Megatron-core's GPTModel for an HF checkpoint: the layer spec (TransformerEngine's when it is
installed, else the local one with agentrl's packed attention), HF weights loaded into this
rank's TP/PP shard, and the whole HF-named tensors gathered back from every rank's shards."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import agentrl.trainer.megatron.saver_compat  # noqa: F401  (before megatron.core: see there)

# isort: split
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from torch import Tensor

from agentrl.config import TrainConfig
from agentrl.trainer.megatron import parallel
from agentrl.trainer.megatron.attention import PackedCoreAttention
from agentrl.trainer.megatron.lora import is_lora_name
from agentrl.trainer.megatron.model_config import (
    ModelShape,
    gpt_model_kwargs,
    transformer_config_kwargs,
)
from agentrl.trainer.megatron.weight_map import WeightMap, layer_offset, to_global_name


def has_transformer_engine() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def layer_spec(shape: ModelShape, use_te: bool) -> Any:
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=shape.has_qk_norm)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=shape.has_qk_norm)
    layer: Any = spec.submodules  # TransformerLayerSubmodules, which megatron types as `object`
    layer.self_attention.submodules.core_attention = PackedCoreAttention
    return spec


def transformer_config(
    shape: ModelShape,
    train_cfg: TrainConfig,
    dtype: torch.dtype,
    *,
    use_swiglu_fusion: bool = False,
    use_wgrad_fusion: bool = False,
) -> Any:
    """`use_swiglu_fusion`: megatron's SwiGLU compiled into one kernel each way (its jit_fuser
    is torch.compile; on CUDA). `use_wgrad_fusion`: weight gradients accumulated by the GEMM
    into the fp32 gradient buffers (TransformerEngine's linear layers do it themselves; the
    others need Apex's extension or `wgrad.install`)."""
    kwargs = transformer_config_kwargs(shape, train_cfg, params_dtype=dtype)
    kwargs.update(
        activation_func=F.silu,
        bias_activation_fusion=use_swiglu_fusion,
        gradient_accumulation_fusion=use_wgrad_fusion,
        bf16=dtype == torch.bfloat16,
        # Losses arrive already divided by the step's global token / sequence counts, so the
        # schedule must neither average them over micro-batches nor DDP over ranks: sum both.
        calculate_per_token_loss=True,
        perform_initialization=False,  # every weight is loaded from the checkpoint
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    return TransformerConfig(**kwargs)


def build_gpt(shape: ModelShape, config: Any, use_te: bool) -> GPTModel:
    """This rank's pipeline stage of the model, on the current device."""
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(shape, use_te),
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        **gpt_model_kwargs(shape, config.tensor_model_parallel_size),
    )
    for param in model.parameters():
        # Without Apex the local spec's norms are torch.nn.RMSNorm in float32 whatever
        # params_dtype says; a half-precision optimizer then loses track of them in its state
        # (dist_checkpointing: "Param id ... does not match any model sharded param"). Megatron's
        # Float16Module casts them the same way.
        if param.is_floating_point() and param.dtype != config.params_dtype:
            param.data = param.data.to(config.params_dtype)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def _offset(shape: ModelShape) -> int:
    return layer_offset(
        ps.get_pipeline_model_parallel_rank(),
        shape.num_layers,
        ps.get_pipeline_model_parallel_world_size(),
    )


def _local_params(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(stage-local name, tensor) of the model's weights, `_extra_state`, buffers and LoRA
    adapters left out."""
    for name, tensor in model.state_dict(keep_vars=True).items():
        if is_lora_name(name) or "_extra_state" in name:
            continue
        if isinstance(tensor, torch.nn.Parameter):
            yield name, tensor


class _SafetensorsDir:
    """Reads HF tensors by name from a checkpoint's *.safetensors files (sharded or not)."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        index = Path(path) / "model.safetensors.index.json"
        files = (
            sorted(set(json.loads(index.read_text())["weight_map"].values()))
            if index.is_file()
            else [p.name for p in Path(path).glob("*.safetensors")]
        )
        self._handles = [safe_open(str(Path(path) / f), framework="pt") for f in files]
        self._where = {k: h for h in self._handles for k in h.keys()}  # noqa: SIM118 (safe_open is not iterable)

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._where:
            raise KeyError(f"{name} is not in the checkpoint's safetensors files")
        return self._where[name].get_tensor(name)


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, wmap: WeightMap, path: str) -> None:
    """Every rank reads the HF tensors of its own parameters and keeps its TP shard."""
    hf = _SafetensorsDir(path)
    offset = _offset(wmap.shape)
    tp_rank = ps.get_tensor_model_parallel_rank()
    for local_name, param in _local_params(model):
        name = to_global_name(local_name, offset)
        whole = wmap.to_megatron(name, [hf[n] for n in wmap.hf_names(name)])
        shard = wmap.split_tp(name, whole)[tp_rank]
        if shard.shape != param.shape:
            raise ValueError(
                f"{name}: checkpoint shard {tuple(shard.shape)} != model {tuple(param.shape)}"
            )
        param.copy_(shard)


def _stage_catalog(
    model: torch.nn.Module, shape: ModelShape
) -> list[list[tuple[str, list[int], str]]]:
    """For every pipeline stage, in order: (global name, TP-shard shape, dtype) of its weights,
    a tied output layer left out (the first stage's embedding is exported)."""
    offset = _offset(shape)
    mine = [
        (to_global_name(n, offset), list(p.shape), str(p.dtype).removeprefix("torch."))
        for n, p in _local_params(model)
        if not (shape.is_tied and n == "output_layer.weight")
    ]
    stages: list[Any] = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, mine, group=parallel.pp_group())
    return stages


@torch.no_grad()
def export_hf_tensors(
    model: torch.nn.Module,
    wmap: WeightMap,
    dtype: torch.dtype | None = None,
    merge: Callable[[str, Tensor], Tensor] | None = None,
) -> Iterator[tuple[str, Tensor]]:
    """(HF name, whole tensor) of the whole model, on every rank. Collective over all model-
    parallel ranks: each tensor is broadcast from its pipeline stage, then all-gathered over TP
    and merged, one at a time. `merge(global name, shard)`: what to send of a local shard (the
    LoRA adapter merged into it)."""
    pp_group = parallel.pp_group()
    tp_group = parallel.tp_group()
    my_stage = ps.get_pipeline_model_parallel_rank()
    offset = _offset(wmap.shape)
    params = {to_global_name(n, offset): p for n, p in _local_params(model)}
    device = next(iter(params.values())).device
    for stage, catalog in enumerate(_stage_catalog(model, wmap.shape)):
        for name, shard_shape, dtype_name in catalog:
            send_dtype = dtype if dtype is not None else getattr(torch, dtype_name)
            if stage == my_stage:
                shard = params[name].detach()
                shard = (merge(name, shard) if merge else shard).to(send_dtype).contiguous()
            else:
                shard = torch.empty(shard_shape, dtype=send_dtype, device=device)
            if dist.get_world_size(pp_group) > 1:
                dist.broadcast(shard, src=dist.get_global_rank(pp_group, stage), group=pp_group)
            if wmap.tp_dim(name) is not None and wmap.tp_size > 1:
                shards = [torch.empty_like(shard) for _ in range(wmap.tp_size)]
                dist.all_gather(shards, shard, group=tp_group)
                shard = wmap.merge_tp(name, shards)
            yield from wmap.to_hf(name, shard)
