"""Packed sequences for both trainer backends: a `MicroBatch` ([rows, T], positions restarting at
0 for every sequence) flattened into the THD form (one row of tokens and the cumulative sequence
lengths, as Megatron takes it), and causal attention over that form in which no token sees
another sequence: FlashAttention-2 as bundled in torch (varlen) on CUDA in half precision,
otherwise SDPA over each sequence. `use_packed_attention` routes a transformers model's attention
through it, so packed rows cost no block mask and no attention across sequences."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

PACKED_ATTENTION = "agentrl_packed"
"""The transformers attention implementation name `use_packed_attention` registers."""


@dataclass
class PackedTokens:
    input_ids: Tensor  # [1, N] long
    position_ids: Tensor  # [1, N] long
    cu_seqlens: Tensor  # [S + 1] int32: sequence i is tokens cu_seqlens[i]:cu_seqlens[i + 1]
    max_seqlen: int
    num_tokens: int  # tokens of the micro-batch; the rest of the N are alignment padding


def pack_tokens(
    input_ids: Tensor, position_ids: Tensor, *, pad_id: int, multiple: int = 1
) -> PackedTokens:
    """[R, T] rows -> one THD row. A sequence starts wherever a position is 0 (right padding of
    unpacked rows continues its row's positions, so it rides at the end of that sequence, after
    every real token, which causal attention never lets it reach). The length is rounded up to
    `multiple` with one extra pad sequence."""
    ids = input_ids.reshape(-1)
    positions = position_ids.reshape(-1)
    num_tokens = ids.numel()
    pad = -num_tokens % multiple
    if pad:
        ids = torch.cat([ids, ids.new_full((pad,), pad_id)])
        positions = torch.cat([positions, torch.arange(pad, device=positions.device)])
    cu_seqlens, max_seqlen = cu_seqlens_of(positions)
    return PackedTokens(
        input_ids=ids[None],
        position_ids=positions[None],
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        num_tokens=num_tokens,
    )


def cu_seqlens_of(positions: Tensor) -> tuple[Tensor, int]:
    """Flat positions [N] -> cumulative sequence lengths [S + 1] (int32; a sequence starts
    wherever a position is 0) and the longest sequence's length."""
    starts = (positions == 0).nonzero()[:, 0]
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("the micro-batch's first position must be 0 (a sequence start)")
    end = torch.tensor([positions.numel()], device=starts.device)
    cu_seqlens = torch.cat([starts, end]).to(torch.int32)
    return cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def packed_causal_attention(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float
) -> Tensor:
    """query [T, H, D], key/value [T, KVH, D] of sequences packed back to back (sequence i is
    rows cu_seqlens[i]:cu_seqlens[i+1]) -> [T, H, D]; no token sees another sequence."""
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        cu = cu_seqlens.to(device=query.device, dtype=torch.int32)
        query, key, value = (t.contiguous() for t in (query, key, value))
        return torch.ops.aten._flash_attention_forward(
            query, key, value, cu, cu, max_seqlen, max_seqlen, 0.0, True, False, scale=scale
        )[0]
    outputs = []
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        q, k, v = (t[start:end].transpose(0, 1)[None] for t in (query, key, value))  # [1, H, L, D]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        outputs.append(out[0].transpose(0, 1))
    return torch.cat(outputs)


def packed_attention_kwargs(position_ids: Tensor) -> dict[str, Any]:
    """What a model under `use_packed_attention` takes beside position_ids [R, T] (every row
    starting a sequence at position 0): the sequence bounds over the flattened rows, in the names
    of transformers' FlashAttentionKwargs, computed once per forward instead of once per layer."""
    if position_ids.shape[-1] == 0 or bool((position_ids[:, 0] != 0).any()):
        raise ValueError("packed attention needs every row to start a sequence (position 0)")
    cu, longest = cu_seqlens_of(position_ids.reshape(-1))
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }


def _hf_packed_attention(
    module: Any,
    query: Tensor,  # [B, H, T, D]
    key: Tensor,  # [B, KVH, T, D]
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature -> ([B, T, H, D], no weights)."""
    if dropout:
        raise ValueError(
            f"packed attention has no dropout (got {dropout}); set attention_dropout=0"
        )
    if "cu_seq_lens_q" not in kwargs:
        raise ValueError(
            "packed attention needs the sequence bounds: call the model with "
            "**packed_attention_kwargs(position_ids)"
        )
    rows, heads, length, dim = query.shape
    device_type = query.device.type
    if query.dtype == torch.float32 and torch.is_autocast_enabled(device_type):
        # Under autocast the rotary embedding leaves q and k in float32; attend in half precision.
        half = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(half), key.to(half), value.to(half)
    q, k, v = (
        t.transpose(1, 2).reshape(rows * length, t.shape[1], dim) for t in (query, key, value)
    )
    scale = scaling if scaling is not None else dim**-0.5
    out = packed_causal_attention(q, k, v, kwargs["cu_seq_lens_q"], kwargs["max_length_q"], scale)
    return out.reshape(rows, length, heads, dim), None


def use_packed_attention(model: Any) -> None:
    """Route a transformers model's attention through `packed_causal_attention`: it then takes
    `packed_attention_kwargs(position_ids)` in every forward and builds no attention mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_ATTENTION, _hf_packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, lambda *args, **kwargs: None)
    model.set_attn_implementation(PACKED_ATTENTION)
    if model.config._attn_implementation != PACKED_ATTENTION:
        raise RuntimeError(
            f"{type(model).__name__} did not take attention implementation {PACKED_ATTENTION!r}: "
            "the torch trainer needs a transformers model built on AttentionInterface"
        )
