"""Micro-batches flattened to THD with cu_seqlens, and causal attention over the packed form that
equals attention over each sequence alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from agentrl.trainer.megatron.attention import PackedCoreAttention
from agentrl.trainer.packing import pack_tokens, packed_causal_attention


def test_packed_row_splits_at_position_zero():
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    packed = pack_tokens(ids, positions, pad_id=0)
    assert packed.cu_seqlens.tolist() == [0, 3, 5, 6] and packed.max_seqlen == 3
    assert packed.cu_seqlens.dtype == torch.int32 and packed.num_tokens == 6


def test_padded_rows_and_alignment():
    ids = torch.tensor([[5, 6, 0, 0], [7, 8, 9, 10]])
    positions = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])  # right padding continues positions
    packed = pack_tokens(ids, positions, pad_id=0, multiple=3)
    assert packed.cu_seqlens.tolist() == [0, 4, 8, 9]  # one pad token as its own sequence
    assert packed.input_ids.shape == (1, 9) and packed.input_ids[0, -1] == 0
    assert packed.num_tokens == 8  # the rows' tokens; the last one aligns


def _qkv(lengths, heads=4, kv_heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    return (torch.randn(total, heads, dim, generator=g), torch.randn(total, kv_heads, dim, generator=g),
            torch.randn(total, kv_heads, dim, generator=g))  # fmt: skip


def test_packed_attention_equals_each_sequence_alone():
    lengths = [3, 5, 1]
    q, k, v = _qkv(lengths)
    cu = torch.tensor([0, 3, 8, 9], dtype=torch.int32)
    out = packed_causal_attention(q, k, v, cu, max_seqlen=5, scale=0.3)
    for start, end in ((0, 3), (3, 8), (8, 9)):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(2, 0), vs.repeat_interleave(2, 0)
        ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=0.3)
        torch.testing.assert_close(out[start:end], ref.transpose(0, 1))


def test_core_attention_module_takes_megatrons_arguments():
    config = SimpleNamespace(attention_dropout=0.0, kv_channels=8)
    module = PackedCoreAttention(config, layer_number=1, attn_mask_type=None)
    q, k, v = _qkv([4, 2])
    params = SimpleNamespace(
        cu_seqlens_q=torch.tensor([0, 4, 6], dtype=torch.int32), max_seqlen_q=4
    )
    packed = module(q, k, v, None, packed_seq_params=params)
    assert packed.shape == (6, 4 * 8)
    torch.testing.assert_close(
        packed.view(6, 4, 8), packed_causal_attention(q, k, v, params.cu_seqlens_q, 4, 1 / 8**0.5)
    )
    with pytest.raises(ValueError, match="takes packed_seq_params"):
        module(q[:4, None], k[:4, None], v[:4, None], None)  # [S, B=1, H, D]: not packed
