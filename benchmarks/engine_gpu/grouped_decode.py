"""The engine's split-K decode kernel (`agentrl/engine/local/decode_attention.py`: one program per
(sequence, KV head, split) serving the KV head's whole query group as one tile) against session
12's first kernel, kept here: one program per query head, so a GQA model's KV head is read once per
query head of its group and only L2 saves the repeats. Timed inside a CUDA graph
(`split_k_decode.timed`) on the shapes of real models, a tiling sweep of the engine's kernel:

    python benchmarks/engine_gpu/grouped_decode.py                  # GPU: the sweep, JSON to --out
    TRITON_INTERPRET=1 python benchmarks/engine_gpu/grouped_decode.py --check   # CPU: exactness
"""

from __future__ import annotations

import argparse
import functools
import json
from typing import Any, cast

import torch
import triton  # pyright: ignore[reportMissingImports]
import triton.language as tl  # pyright: ignore[reportMissingImports]

from agentrl.engine.local.decode_attention import _combine_kernel, num_splits, split_k_decode


@triton.jit
def _per_head_kernel(
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


def per_head_decode(q, keys, values, kv_start, kv_len, scale, splits, *, block_n=64, num_warps=2):
    """Session 12's first kernel: one program per (sequence, query head, split)."""
    batch, heads, dim = q.shape
    out = torch.empty_like(q)
    mid_o = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    cast(Any, _per_head_kernel)[(batch, heads, splits)](
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


def arena(batch, context, heads, kv_heads, dim, device, dtype, seed=0):
    """A head-major arena with `batch` slots of `context` + 64 rows, every sequence `context`
    long (its tail garbage), and one strided query a sequence."""
    g = torch.Generator().manual_seed(seed)
    slot = context + 64
    keys, values = (torch.randn(kv_heads, slot * batch, dim, generator=g).to(device, dtype)
                    .permute(1, 0, 2) for _ in range(2))  # fmt: skip
    q = torch.randn(batch, heads + 2 * kv_heads, dim, generator=g).to(device, dtype)[:, :heads]
    start = torch.arange(batch, dtype=torch.int32, device=device) * slot
    length = torch.full((batch,), context, dtype=torch.int32, device=device)
    return q, keys, values, start, length, dim**-0.5


def check() -> None:
    """Both kernels agree on GQA groups of 3, 4 and 7 with 1 and 4 splits (fp32; on CUDA the
    engine's `tl.dot` rounds fp32 inputs to TF32, so there the tolerance is TF32's)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for heads, kv_heads, splits in [(9, 3, 1), (9, 3, 4), (8, 2, 1), (28, 4, 4)]:
        args = arena(3, 150, heads, kv_heads, 16, device, torch.float32)
        args[4][0] = 1  # one sequence of one key: most of its splits empty
        want = per_head_decode(*args, splits)
        got = split_k_decode(*args, splits, block_n=32)
        tol = 1e-4 if device == "cpu" else 5e-3
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        print(f"heads {heads}/{kv_heads} splits {splits}: equal", flush=True)


def bench(batch, context, heads, kv_heads, dim) -> list[dict]:
    from split_k_decode import timed  # the sibling script: the same in-graph timing

    args = arena(batch, context, heads, kv_heads, dim, "cuda", torch.bfloat16)
    sms = torch.cuda.get_device_properties("cuda").multi_processor_count
    per_head = functools.partial(per_head_decode, *args, num_splits(batch, heads, sms))
    engine = functools.partial(split_k_decode, *args, num_splits(batch, kv_heads, sms))
    rows = [{"kernel": "per query head", "s": timed(per_head)},
            {"kernel": "engine (default tiling)", "s": timed(engine)}]  # fmt: skip
    want = per_head().float()
    for block_n in (32, 64, 128):
        for warps in (2, 4, 8):
            fn = functools.partial(split_k_decode, *args, num_splits(batch, kv_heads, sms),
                                   block_n=block_n, num_warps=warps)  # fmt: skip
            torch.testing.assert_close(fn().float(), want, atol=2e-2, rtol=2e-2)
            rows.append({"kernel": f"engine n{block_n} w{warps}", "s": timed(fn)})
    kv_bytes = 2 * batch * context * kv_heads * dim * 2
    for row in rows:
        row.update(batch=batch, context=context, heads=heads, kv_heads=kv_heads, dim=dim,
                   us=row["s"] * 1e6, gb_s=kv_bytes / row["s"] / 1e9)  # fmt: skip
    return rows


SHAPES = {  # heads, KV heads, head dim
    "smollm2-1.7b": (32, 32, 64),
    "smollm2-135m": (9, 3, 64),
    "qwen2.5-7b": (28, 4, 128),
    "llama-3-8b": (32, 8, 128),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exactness only (CPU: interpreter)")
    parser.add_argument("--cases", default="1x2048,64x384,128x384,64x2048")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.check:
        check()
        return
    results = []
    for name, (heads, kv_heads, dim) in SHAPES.items():
        for case in args.cases.split(","):
            batch, context = map(int, case.split("x"))
            rows = bench(batch, context, heads, kv_heads, dim)
            fastest = min(rows[2:], key=lambda r: r["s"])
            for row in (rows[0], rows[1], fastest):
                print(f"{name} b={batch} ctx={context} {row['kernel']:<24} {row['us']:8.1f} us "
                      f"{row['gb_s']:6.0f} GB/s", flush=True)  # fmt: skip
            results += [dict(row, shape=name) for row in rows]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
