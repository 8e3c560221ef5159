"""Causal self-attention over packed sequences (THD with `cu_seqlens`, `trainer.packing`), for the
core-attention slot of Megatron's local layer spec, whose own DotProductAttention takes no packed
sequences and TransformerEngine (which does) is not installed. Plain torch: no megatron import."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from agentrl.trainer.packing import packed_causal_attention


class PackedCoreAttention(torch.nn.Module):
    """Drop-in for megatron.core's DotProductAttention (same constructor and forward arguments)
    on packed input, which is all the Megatron backend feeds it: query [T, H/tp, D] ->
    [T, H/tp * D]."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any = None,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        **_: Any,
    ) -> None:
        super().__init__()
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) > 0:
            raise ValueError("PackedCoreAttention has no dropout: set attention_dropout=0")
        self.scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None = None,
        attn_mask_type: Any = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
        **_: Any,
    ) -> Tensor:
        if attention_bias is not None or packed_seq_params is None:
            raise ValueError("PackedCoreAttention takes packed_seq_params and no attention_bias")
        out = packed_causal_attention(
            query,
            key,
            value,
            packed_seq_params.cu_seqlens_q,
            int(packed_seq_params.max_seqlen_q),
            self.scale,
        )
        return out.reshape(out.shape[0], -1)
