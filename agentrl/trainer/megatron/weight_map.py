"""HF <-> Megatron-core weight names and layouts for Llama / Qwen2 / Qwen3, as pure functions of
a `ModelShape`: fused QKV (per query group: its query heads, then its key, then its value),
fused gate/up (linear_fc1), tensor-parallel split and merge, pipeline layer offsets.

mbridge (verl's bridge) holds the same conversions, but only for TransformerEngine's layer names
and behind an object that needs an initialised Megatron process state; agentrl also builds the
local layer spec (no TransformerEngine), so the map lives here, tested on CPU against both the
real configs and mbridge's layouts."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from agentrl.trainer.megatron.model_config import ModelShape

LayerSpec = Literal["local", "te"]
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Per-layer Megatron suffix -> HF suffixes (under model.layers.{i}.), both layer specs.
_ATTENTION = {
    "self_attention.linear_qkv.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "self_attention.linear_qkv.bias": (
        "self_attn.q_proj.bias",
        "self_attn.k_proj.bias",
        "self_attn.v_proj.bias",
    ),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight",),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight",),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
}
# The layer norms: separate modules in the local spec, fused into the next linear in TE's.
_NORMS = {
    "local": {
        "input_layernorm.weight": ("input_layernorm.weight",),
        "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight",),
    },
    "te": {
        "self_attention.linear_qkv.layer_norm_weight": ("input_layernorm.weight",),
        "mlp.linear_fc1.layer_norm_weight": ("post_attention_layernorm.weight",),
    },
}
_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")  # split inputs
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")  # split vocab rows


@dataclass(frozen=True)
class WeightMap:
    shape: ModelShape
    spec: LayerSpec = "local"
    tp_size: int = 1

    # ------------------------------------------------------------ names

    def layer_suffixes(self) -> dict[str, tuple[str, ...]]:
        s = self.shape
        out = {**_NORMS[self.spec], **_ATTENTION}
        if not s.has_qkv_bias:
            del out["self_attention.linear_qkv.bias"]
        if not s.has_qk_norm:
            del out["self_attention.q_layernorm.weight"], out["self_attention.k_layernorm.weight"]
        return out

    def megatron_names(self) -> list[str]:
        """Every Megatron parameter of the whole model (global layer numbers), a tied output
        layer left out as Megatron's GPTModel leaves it out of the last stage's parameters."""
        names = ["embedding.word_embeddings.weight"]
        for i in range(self.shape.num_layers):
            names += [f"decoder.layers.{i}.{suffix}" for suffix in self.layer_suffixes()]
        names.append("decoder.final_layernorm.weight")
        if not self.shape.is_tied:
            names.append("output_layer.weight")
        return names

    def hf_names(self, name: str) -> tuple[str, ...]:
        """The HF tensors one Megatron parameter is made of (global layer numbers)."""
        if name == "output_layer.weight" and self.shape.is_tied:
            return (_TOP["embedding.word_embeddings.weight"],)  # the last stage's copy (PP > 1)
        if name in _TOP:
            return (_TOP[name],)
        match = _LAYER.match(name)
        suffixes = self.layer_suffixes()
        if not match or match.group(2) not in suffixes:
            raise KeyError(
                f"{name!r} is not a {self.shape.family} Megatron parameter ({self.spec} spec)"
            )
        return tuple(f"model.layers.{match.group(1)}.{s}" for s in suffixes[match.group(2)])

    # ------------------------------------------------------------ layouts (whole tensors)

    def to_megatron(self, name: str, hf: list[Tensor]) -> Tensor:
        """HF tensors -> the whole Megatron parameter (vocab rows padded for TP)."""
        if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
            return self._fuse_qkv(*hf)
        if name.endswith("linear_fc1.weight"):
            return torch.cat(hf, dim=0)
        (tensor,) = hf
        if name in _VOCAB:
            pad = self.shape.padded_vocab_size(self.tp_size) - tensor.shape[0]
            tensor = (
                torch.cat([tensor, tensor.new_zeros(pad, *tensor.shape[1:])]) if pad else tensor
            )
        return tensor

    def to_hf(self, name: str, tensor: Tensor) -> list[tuple[str, Tensor]]:
        """The whole Megatron parameter -> (HF name, tensor) pairs."""
        names = self.hf_names(name)
        if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
            return list(zip(names, self._split_qkv(tensor), strict=True))
        if name.endswith("linear_fc1.weight"):
            return list(zip(names, tensor.chunk(2, dim=0), strict=True))
        if name in _VOCAB:
            tensor = tensor[: self.shape.vocab_size]
        return [(names[0], tensor)]

    def _fuse_qkv(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """[nh*d], [ng*d], [ng*d] rows -> [ng * (nh/ng + 2) * d] rows, grouped per query group."""
        s = self.shape
        rest = q.shape[1:]
        groups = [
            q.reshape(s.num_kv_heads, -1, *rest),  # [ng, nh/ng * d, ...]
            k.reshape(s.num_kv_heads, s.head_dim, *rest),
            v.reshape(s.num_kv_heads, s.head_dim, *rest),
        ]
        return torch.cat(groups, dim=1).reshape(-1, *rest)

    def _split_qkv(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        s = self.shape
        rest = qkv.shape[1:]
        grouped = qkv.reshape(s.num_kv_heads, -1, *rest)
        q_rows = s.num_heads // s.num_kv_heads * s.head_dim
        q, k, v = grouped.split([q_rows, s.head_dim, s.head_dim], dim=1)
        return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)

    # ------------------------------------------------------------ tensor parallel

    def split_tp(self, name: str, tensor: Tensor) -> list[Tensor]:
        """The whole Megatron parameter -> one shard per TP rank (equal to it if replicated).
        Fused QKV splits by query group; fused gate/up gives each rank its gate rows then its
        up rows; row-parallel weights split their input dim; vocab matrices their rows."""
        tp = self.tp_size
        if name.endswith("linear_fc1.weight"):
            gate, up = tensor.chunk(2, dim=0)
            return [torch.cat(pair) for pair in zip(gate.chunk(tp), up.chunk(tp), strict=True)]
        dim = self.tp_dim(name)
        return [tensor] * tp if dim is None else list(tensor.chunk(tp, dim=dim))

    def merge_tp(self, name: str, shards: list[Tensor]) -> Tensor:
        """Inverse of `split_tp`."""
        if name.endswith("linear_fc1.weight"):
            pairs = [shard.chunk(2, dim=0) for shard in shards]
            return torch.cat([g for g, _ in pairs] + [u for _, u in pairs])
        dim = self.tp_dim(name)
        return shards[0] if dim is None else torch.cat(shards, dim=dim)

    def tp_dim(self, name: str) -> int | None:
        """The dim a parameter is split along over TP ranks; None = replicated."""
        suffix = found.group(2) if (found := _LAYER.match(name)) else name
        if suffix in _ROW_PARALLEL:
            return 1
        column = (
            "self_attention.linear_qkv.weight",
            "self_attention.linear_qkv.bias",
            "mlp.linear_fc1.weight",
            *_VOCAB,
        )
        return 0 if suffix in column else None

    # ------------------------------------------------------------ whole state dicts

    def hf_to_megatron(self, get: Callable[[str], Tensor]) -> Iterator[tuple[str, Tensor]]:
        """(Megatron name, whole tensor) for every parameter, reading HF tensors by name."""
        for name in self.megatron_names():
            yield name, self.to_megatron(name, [get(n) for n in self.hf_names(name)])

    def megatron_to_hf(self, named: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        for name, tensor in named:
            yield from self.to_hf(name, tensor)


def layer_offset(pp_rank: int, num_layers: int, pp_size: int) -> int:
    """The global number of a pipeline stage's first layer (layers split evenly)."""
    return pp_rank * (num_layers // pp_size)


def to_global_name(local_name: str, offset: int) -> str:
    """A stage's parameter name (layers numbered from 0 on every stage) -> the model-wide name."""
    match = _LAYER.match(local_name)
    if not match:
        return local_name
    return f"decoder.layers.{int(match.group(1)) + offset}.{match.group(2)}"
