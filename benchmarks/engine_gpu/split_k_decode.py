"""Experiment for issue 28 (not used by the engine yet): a split-K ("flash-decoding") attention
for the decode step over the engine's KV arena, in Triton.

Why: on the H100 (session 10), torch's bundled FlashAttention-2 forward takes half of a 1.7B
batch-64 decode step and reads the KV at about a third of the copy bandwidth: it runs its
128-row query blocks for one query a sequence and never splits the keys. Here each (sequence,
query head, split) program reads one contiguous run of its sequence's keys; a second kernel
combines the splits by their log-sum-exp.

Layout as the arena's: keys/values [rows, KVH, D] with any row/head strides (row major or head
major), sequence b's keys at rows kv_start[b] .. kv_start[b] + kv_len[b]. Grouped-query
attention: query head h reads kv head h // (H // KVH). The grid depends only on (B, H, splits),
so it can be captured in a CUDA graph; lengths are read on the device.

    python benchmarks/engine_gpu/split_k_decode.py --check        # CPU: TRITON_INTERPRET=1 is set
    python benchmarks/engine_gpu/split_k_decode.py --bench        # CUDA: against torch's FA2 varlen
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

if "--check" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, start_ptr, len_ptr, mid_o_ptr, mid_lse_ptr,
    stride_qb, stride_qh,
    stride_kr, stride_kh, stride_vr, stride_vh,
    stride_mb, stride_mh, stride_ms,
    scale, chunk,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_head = h // GROUP
    start = tl.load(start_ptr + b)
    length = tl.load(len_ptr + b)
    lo = s * chunk
    hi = tl.minimum(lo + chunk, length)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d).to(tl.float32) * scale
    m = tl.full([], float("-inf"), tl.float32)  # typed: loop-carried
    l_sum = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([D], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        live = n < hi
        rows = (start + n)[:, None]
        k = tl.load(k_ptr + rows * stride_kr + kv_head * stride_kh + d[None, :],
                    mask=live[:, None], other=0.0).to(tl.float32)  # fmt: skip
        scores = tl.where(live, tl.sum(k * q[None, :], axis=1), -float("inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m - m_new)
        v = tl.load(v_ptr + rows * stride_vr + kv_head * stride_vh + d[None, :],
                    mask=live[:, None], other=0.0).to(tl.float32)  # fmt: skip
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_sum = l_sum * alpha + tl.sum(p, axis=0)
        m = m_new
    base = b * stride_mb + h * stride_mh + s * stride_ms
    out = tl.where(l_sum > 0, acc / l_sum, 0.0)
    tl.store(mid_o_ptr + base * D + d, out)
    tl.store(mid_lse_ptr + base, tl.where(l_sum > 0, m + tl.log(l_sum), -float("inf")))


@triton.jit
def _combine_kernel(
    mid_o_ptr, mid_lse_ptr, o_ptr, stride_mb, stride_mh, stride_ob, stride_oh,
    SPLITS: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    b, h = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    base = b * stride_mb + h * stride_mh
    lse = tl.load(mid_lse_ptr + base + s)
    m = tl.max(lse, axis=0)
    w = tl.where(lse > -float("inf"), tl.exp(lse - m), 0.0)
    parts = tl.load(mid_o_ptr + (base + s)[:, None] * D + d[None, :])
    out = tl.sum(w[:, None] * parts, axis=0) / tl.sum(w, axis=0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + d, out.to(o_ptr.dtype.element_ty))


def split_k_decode(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kv_start: torch.Tensor,
    kv_len: torch.Tensor,
    *,
    max_len: int,
    scale: float,
    splits: int = 8,
    block_n: int = 64,
) -> torch.Tensor:
    """`q` [B, H, D] (one query a sequence), `keys`/`values` [rows, KVH, D] (last dim unit stride),
    `kv_start`/`kv_len` [B] int32. `max_len` bounds every kv_len (a graph's static bound).
    Returns [B, H, D] in q's dtype."""
    batch, heads, dim = q.shape
    kv_heads = keys.shape[1]
    chunk = math.ceil(math.ceil(max_len / splits) / block_n) * block_n
    mid_o = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    _split_kernel[(batch, heads, splits)](
        q, keys, values, kv_start, kv_len, mid_o, mid_lse,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        heads * splits, splits, 1, scale, chunk,
        GROUP=heads // kv_heads, D=dim, BLOCK_N=block_n,
    )  # fmt: skip
    out = torch.empty_like(q)
    _combine_kernel[(batch, heads)](
        mid_o, mid_lse, out, heads * splits, splits, out.stride(0), out.stride(1),
        SPLITS=splits, D=dim,
    )  # fmt: skip
    return out


def reference(q, keys, values, kv_start, kv_len, scale):
    """Per sequence, SDPA in fp32 over its own keys."""
    out = []
    group = q.shape[1] // keys.shape[1]
    for b in range(q.shape[0]):
        s, n = int(kv_start[b]), int(kv_len[b])
        k = keys[s : s + n].float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, n, D]
        v = values[s : s + n].float().repeat_interleave(group, dim=1).transpose(0, 1)
        w = torch.softmax((q[b].float()[:, None, :] @ k.transpose(1, 2))[:, 0] * scale, dim=-1)
        out.append((w[:, None, :] @ v)[:, 0])
    return torch.stack(out).to(q.dtype)


def arena(rows: int, kv_heads: int, dim: int, dtype, device, head_major: bool, g):
    def one():
        if head_major:
            return torch.randn(kv_heads, rows, dim, generator=g).to(device, dtype).permute(1, 0, 2)
        return torch.randn(rows, kv_heads, dim, generator=g).to(device, dtype)

    return one(), one()


def check() -> None:
    """Against the reference: GQA and MHA, row and head major, lengths 1 .. slot length, a split
    that is empty, fp32 and (on CUDA) bf16."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    cases = [(4, 2, 32, torch.float32), (6, 6, 16, torch.float32)]
    if device == "cuda":
        cases.append((32, 32, 64, torch.bfloat16))
    for heads, kv_heads, dim, dtype in cases:
        for head_major in (False, True):
            slot, lens = 200, [1, 7, 64, 65, 200, 3]
            keys, values = arena(slot * len(lens), kv_heads, dim, dtype, device, head_major, g)
            q = torch.randn(len(lens), heads, dim, generator=g).to(device, dtype)
            start = torch.tensor([i * slot for i in range(len(lens))], dtype=torch.int32,
                                 device=device)  # fmt: skip
            length = torch.tensor(lens, dtype=torch.int32, device=device)
            scale = dim**-0.5
            got = split_k_decode(q, keys, values, start, length, max_len=slot, scale=scale,
                                 splits=4, block_n=16)  # fmt: skip
            want = reference(q, keys, values, start, length, scale)
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
            print(f"ok: H={heads} KVH={kv_heads} D={dim} {dtype} head_major={head_major}")


def bench(batch: int, context: int, heads: int = 32, kv_heads: int = 32, dim: int = 64) -> None:
    """One layer's decode attention, 1.7B shape: split-K against torch's FA2 varlen call as the
    engine makes it, both on the same head-major arena, CUDA-event timed over 200 calls."""
    g = torch.Generator().manual_seed(0)
    slot = context + 64
    keys, values = arena(slot * batch, kv_heads, dim, torch.bfloat16, "cuda", True, g)
    q = torch.randn(batch, heads, dim, generator=g).to("cuda", torch.bfloat16)
    start = torch.arange(batch, dtype=torch.int32, device="cuda") * slot
    length = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    cu_k = torch.cat([start, start[-1:]])

    def flash():
        return torch.ops.aten._flash_attention_forward(
            q, keys, values, cu_q, cu_k, 1, slot, 0.0, True, False, scale=dim**-0.5,
            seqused_k=length,
        )[0]  # fmt: skip

    def timed(fn) -> float:
        for _ in range(10):
            fn()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(200):
            fn()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / 200

    kv_bytes = 2 * batch * context * kv_heads * dim * 2
    for splits in (4, 8, 16):
        ms = timed(lambda s=splits: split_k_decode(q, keys, values, start, length, max_len=slot,
                                                  scale=dim**-0.5, splits=s))  # fmt: skip
        print(f"b={batch} ctx={context} split_k({splits}) {ms * 1e3:.1f} us "
              f"{kv_bytes / ms / 1e6:.0f} GB/s")  # fmt: skip
    ms = timed(flash)
    print(f"b={batch} ctx={context} fa2_varlen  {ms * 1e3:.1f} us {kv_bytes / ms / 1e6:.0f} GB/s")
    torch.testing.assert_close(
        split_k_decode(q, keys, values, start, length, max_len=slot, scale=dim**-0.5).float(),
        flash()[:, :, :].float(), atol=2e-2, rtol=2e-2,
    )  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--bench", action="store_true")
    args = parser.parse_args()
    if args.check:
        check()
    if args.bench:
        for batch, context in ((64, 256), (128, 256), (64, 1024), (1, 2048)):
            bench(batch, context)
