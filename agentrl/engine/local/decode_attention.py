"""Split-K ("flash-decoding") attention for decode steps over the KV arena, in Triton.

torch's FlashAttention-2 runs 128-row query blocks for a decoding sequence's one query and never
splits the keys (on an H100: a third of the copy bandwidth, half of a 1.7B batch-64 step). Here
each (sequence, KV head, split) program reads its split's share of that sequence's keys (length
read on the device) once for all the query heads sharing them (GQA: one query tile of >= 16 rows,
the least `tl.dot` takes); a second kernel combines the splits by log-sum-exp. The grid depends
only on the batch, KV heads and splits: the step is captured in a CUDA graph as it is. Imported
only where it runs (CUDA with triton; `TRITON_INTERPRET=1` runs it on CPU for tests).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import triton  # pyright: ignore[reportMissingImports]  (ships with CUDA builds of torch)
import triton.language as tl  # pyright: ignore[reportMissingImports]

NUM_WARPS = 4  # H100 sweep (benchmarks/engine_gpu/grouped_decode.py): with 4096 // D keys a block,
# within 11% of the best tiling on SmolLM2-135M, Qwen2.5-7B, Llama-3-8B shapes at batch 1 to 128


@triton.jit
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    start_ptr,
    len_ptr,
    o_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    stride_qb,
    stride_qh,
    stride_kr,
    stride_kh,
    stride_vr,
    stride_vh,
    stride_ob,
    stride_oh,
    scale,
    HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    SPLITS: tl.constexpr,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    s = tl.program_id(2)
    start = tl.load(start_ptr + b).to(tl.int64)
    length = tl.load(len_ptr + b)
    share = (length + SPLITS - 1) // SPLITS  # this sequence's keys per split, whole blocks
    chunk = (share + BLOCK - 1) // BLOCK * BLOCK
    lo = s * chunk
    hi = tl.minimum(lo + chunk, length)
    g = tl.arange(0, BLOCK_H)
    # rows past the group pad the tile
    heads = kv_head * GROUP + g
    in_group = g < GROUP
    d = tl.arange(0, D)
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=in_group[:, None],
        other=0.0,
    )
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    kv_at = kv_head.to(tl.int64)
    for n0 in range(lo, hi, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        live = n < hi
        rows = (start + n)[:, None]
        # both reads issued before any arithmetic on them: both are in flight at once
        k = tl.load(
            k_ptr + rows * stride_kr + kv_at * stride_kh + d[None, :], mask=live[:, None], other=0.0
        )
        v = tl.load(
            v_ptr + rows * stride_vr + kv_at * stride_vh + d[None, :], mask=live[:, None], other=0.0
        )
        scores = tl.where(live[None, :], tl.dot(q, tl.trans(k)) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        total = total * alpha + tl.sum(p, axis=1)
        m = m_new
    if SPLITS == 1:  # the whole sequence: the output itself, no combining pass
        out = (acc / total[:, None]).to(o_ptr.dtype.element_ty)
        tl.store(
            o_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
            out,
            mask=in_group[:, None],
        )
    else:
        at = (b * HEADS + heads) * SPLITS + s
        mid = tl.where(total[:, None] > 0, acc / total[:, None], 0.0)
        tl.store(mid_o_ptr + at[:, None] * D + d[None, :], mid, mask=in_group[:, None])
        lse = tl.where(total > 0, m + tl.log(total), float("-inf"))
        tl.store(mid_lse_ptr + at, lse, mask=in_group)


@triton.jit
def _combine_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    o_ptr,
    stride_ob,
    stride_oh,
    HEADS: tl.constexpr,
    SPLITS: tl.constexpr,
    D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    at = (b * HEADS + h) * SPLITS
    lse = tl.load(mid_lse_ptr + at + s)
    m = tl.max(lse, axis=0)
    w = tl.where(lse > float("-inf"), tl.exp(lse - m), 0.0)  # an empty split weighs nothing
    parts = tl.load(mid_o_ptr + (at + s)[:, None] * D + d[None, :])
    out = tl.sum(w[:, None] * parts, axis=0) / tl.sum(w, axis=0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + d, out.to(o_ptr.dtype.element_ty))


def num_splits(batch: int, kv_heads: int, num_sms: int) -> int:
    """Enough splits that the programs (one per sequence and KV head) fill the device about twice
    (a power of two, 1 to 16): one sequence alone splits 16 ways, a batch of 64 with 32 KV heads
    already fills it unsplit."""
    want = -(-2 * num_sms // (batch * kv_heads))
    return min(16, 1 << max(0, want - 1).bit_length())


def split_k_decode(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kv_start: torch.Tensor,
    kv_len: torch.Tensor,
    scale: float,
    splits: int,
    *,
    block_n: int | None = None,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """`q` [B, H, D] (one query a sequence), `keys`/`values` [rows, KVH, D] in the arena's layout
    (row or head major; unit last stride), sequence b's keys at rows kv_start[b] ..
    kv_start[b] + kv_len[b] (int32, [B], kv_len[b] >= 1). Returns [B, H, D] in q's dtype.
    `block_n` (keys a block; default 4096 // D within 16..64), `num_warps`: the tiling."""
    (batch, heads, dim) = q.shape
    kv_heads = keys.shape[1]
    out = torch.empty_like(q)
    mid_o = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    cast(Any, _split_kernel)[(batch, kv_heads, splits)](
        q,
        keys,
        values,
        kv_start,
        kv_len,
        out,
        mid_o,
        mid_lse,
        q.stride(0),
        q.stride(1),
        keys.stride(0),
        keys.stride(1),
        values.stride(0),
        values.stride(1),
        out.stride(0),
        out.stride(1),
        scale,
        HEADS=heads,
        GROUP=heads // kv_heads,
        SPLITS=splits,
        D=dim,
        BLOCK=block_n or max(16, min(64, 4096 // dim)),
        BLOCK_H=max(16, triton.next_power_of_2(heads // kv_heads)),
        num_warps=num_warps,
    )
    if splits > 1:
        cast(Any, _combine_kernel)[(batch, heads)](
            mid_o, mid_lse, out, out.stride(0), out.stride(1), HEADS=heads, SPLITS=splits, D=dim
        )
    return out
