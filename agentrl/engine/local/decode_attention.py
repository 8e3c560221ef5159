"""Split-K ("flash-decoding") attention for decode steps over the KV arena, in Triton.

Why: torch's bundled FlashAttention-2 runs its 128-row query blocks for the one query a decoding
sequence has and never splits the keys; on an H100 it read the arena at about a third of the
copy bandwidth and took half of a 1.7B batch-64 decode step. Here each (sequence, query head,
split) program reads one contiguous run of its sequence's keys (the split's share of that
sequence's own length, read on the device), and a second kernel combines the splits by their
log-sum-exp. The grid depends only on the batch, the heads and the split count, so the step is
captured in a CUDA graph as it is.

Imported only where it runs (CUDA with triton; `TRITON_INTERPRET=1` runs it on CPU for tests).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import triton  # pyright: ignore[reportMissingImports]  (ships with CUDA builds of torch)
import triton.language as tl  # pyright: ignore[reportMissingImports]

BLOCK_N = 64  # keys a program reads per iteration
NUM_WARPS = 2  # in-graph sweep on an H100 (benchmarks/engine_gpu/session12): 2 warps beat 4 at
# every batch (1.7B shape, batch 128, 384 keys: 143 against 152 us a layer, 2.8 TB/s; 135M shape:
# 23 against 40 us), and 64 keys a block was within 11% of the best tiling in every case


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, start_ptr, len_ptr, o_ptr, mid_o_ptr, mid_lse_ptr,
    stride_qb, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh, stride_ob, stride_oh, scale,
    HEADS: tl.constexpr, GROUP: tl.constexpr, SPLITS: tl.constexpr, D: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_head = (h // GROUP).to(tl.int64)
    start = tl.load(start_ptr + b).to(tl.int64)
    length = tl.load(len_ptr + b)
    share = (length + SPLITS - 1) // SPLITS  # this sequence's keys per split, whole blocks
    chunk = (share + BLOCK - 1) // BLOCK * BLOCK
    lo = s * chunk
    hi = tl.minimum(lo + chunk, length)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d).to(tl.float32) * scale
    m = tl.full([], float("-inf"), tl.float32)  # typed: loop-carried
    total = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([D], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        live = n < hi
        rows = (start + n)[:, None]
        # both reads issued before any arithmetic on them: both are in flight at once
        k = tl.load(k_ptr + rows * stride_kr + kv_head * stride_kh + d[None, :],
                    mask=live[:, None], other=0.0).to(tl.float32)  # fmt: skip
        v = tl.load(v_ptr + rows * stride_vr + kv_head * stride_vh + d[None, :],
                    mask=live[:, None], other=0.0).to(tl.float32)  # fmt: skip
        scores = tl.where(live, tl.sum(k * q[None, :], axis=1), float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m - m_new)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        total = total * alpha + tl.sum(p, axis=0)
        m = m_new
    if SPLITS == 1:  # the whole sequence: the output itself, no combining pass
        out = (acc / total).to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + b * stride_ob + h * stride_oh + d, out)
    else:
        at = (b * HEADS + h) * SPLITS + s
        tl.store(mid_o_ptr + at * D + d, tl.where(total > 0, acc / total, 0.0))
        tl.store(mid_lse_ptr + at, tl.where(total > 0, m + tl.log(total), float("-inf")))


@triton.jit
def _combine_kernel(
    mid_o_ptr, mid_lse_ptr, o_ptr, stride_ob, stride_oh,
    HEADS: tl.constexpr, SPLITS: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    b, h = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    at = (b * HEADS + h) * SPLITS
    lse = tl.load(mid_lse_ptr + at + s)
    m = tl.max(lse, axis=0)
    w = tl.where(lse > float("-inf"), tl.exp(lse - m), 0.0)  # an empty split weighs nothing
    parts = tl.load(mid_o_ptr + (at + s)[:, None] * D + d[None, :])
    out = tl.sum(w[:, None] * parts, axis=0) / tl.sum(w, axis=0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + d, out.to(o_ptr.dtype.element_ty))


def num_splits(batch: int, heads: int, num_sms: int) -> int:
    """Enough splits that the programs fill the device about twice (a power of two, 1 to 16):
    one sequence alone splits 16 ways, a batch of 64 already fills it unsplit."""
    want = -(-2 * num_sms // (batch * heads))
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
    block_n: int = BLOCK_N,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """`q` [B, H, D] (one query a sequence), `keys`/`values` [rows, KVH, D] in the arena's layout
    (row or head major; unit last stride), sequence b's keys at rows kv_start[b] ..
    kv_start[b] + kv_len[b] (int32, [B], kv_len[b] >= 1). Returns [B, H, D] in q's dtype.
    `block_n`, `num_warps`: the tiling (benchmarks/engine_gpu/split_k_decode.py sweeps them)."""
    batch, heads, dim = q.shape
    out = torch.empty_like(q)
    mid_o = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    cast(Any, _split_kernel)[(batch, heads, splits)](
        q, keys, values, kv_start, kv_len, out, mid_o, mid_lse,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0),
        values.stride(1), out.stride(0), out.stride(1), scale,
        HEADS=heads, GROUP=heads // keys.shape[1], SPLITS=splits, D=dim, BLOCK=block_n,
        num_warps=num_warps,
    )  # fmt: skip
    if splits > 1:
        cast(Any, _combine_kernel)[(batch, heads)](
            mid_o, mid_lse, out, out.stride(0), out.stride(1), HEADS=heads, SPLITS=splits, D=dim
        )
    return out
