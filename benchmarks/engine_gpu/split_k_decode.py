"""The engine's split-K decode attention (`agentrl/engine/local/decode_attention.py`) on one layer
of a decode step, against torch's FlashAttention-2 varlen call as the engine made it before, on
the same head-major arena: time per call (inside a CUDA graph: 10 replays of 20 calls) and the KV bytes
read per second, for a sweep of tilings (keys per block, warps) and split counts.

    python benchmarks/engine_gpu/split_k_decode.py                 # 1.7B shape: 32 heads, D 64
    python benchmarks/engine_gpu/split_k_decode.py --heads 9 --kv-heads 3    # 135M shape
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from agentrl.engine.local.decode_attention import num_splits, split_k_decode


def timed(fn) -> float:
    """Seconds per call inside a CUDA graph of 20 calls, as the engine's decode graphs run it
    (outside a graph, Python's launch cost hides the kernel at these sizes)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # compiles, allocates
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / 200 * 1e-3


def bench(batch: int, context: int, heads: int, kv_heads: int, dim: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    slot = context + 64
    keys, values = (torch.randn(kv_heads, slot * batch, dim, generator=g).to("cuda", torch.bfloat16)
                    .permute(1, 0, 2) for _ in range(2))  # fmt: skip
    q = torch.randn(batch, heads, dim, generator=g).to("cuda", torch.bfloat16)
    start = torch.arange(batch, dtype=torch.int32, device="cuda") * slot
    length = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    cu_k = torch.cat([start, start[-1:]])
    scale = dim**-0.5

    def flash():
        return torch.ops.aten._flash_attention_forward(
            q, keys, values, cu_q, cu_k, 1, slot, 0.0, True, False, scale=scale, seqused_k=length
        )[0]

    kv_bytes = 2 * batch * context * kv_heads * dim * 2
    sms = torch.cuda.get_device_properties("cuda").multi_processor_count
    default = num_splits(batch, kv_heads, sms)
    engine = functools.partial(split_k_decode, q, keys, values, start, length, scale, default)
    rows = [{"kernel": "fa2_varlen", "s": timed(flash)},
            {"kernel": "split_k (engine's tiling)", "engine": True, "s": timed(engine)}]  # fmt: skip
    split_counts = sorted({default, min(16, 2 * default), min(16, 4 * default)})
    tilings = [(s, n, w) for s in split_counts for n in (32, 64, 128, 256) for w in (2, 4, 8)]
    for splits, block_n, warps in tilings:
        fn = functools.partial(split_k_decode, q, keys, values, start, length, scale, splits,
                               block_n=block_n, num_warps=warps)  # fmt: skip
        torch.testing.assert_close(fn().float(), flash().float(), atol=2e-2, rtol=2e-2)
        rows.append({"kernel": f"split_k s{splits} n{block_n} w{warps}", "s": timed(fn)})
    for row in rows:
        row.update(batch=batch, context=context, us=row["s"] * 1e6,
                   gb_s=kv_bytes / row["s"] / 1e9)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--cases", default="64x256,128x256,128x384,64x1024,1x384,1x2048")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = []
    for case in args.cases.split(","):
        batch, context = map(int, case.split("x"))
        rows = bench(batch, context, args.heads, args.kv_heads, args.dim)
        fastest = sorted(rows[2:], key=lambda r: r["s"])[:3]
        for row in [*rows[:2], *fastest]:
            print(f"b={batch} ctx={context} {row['kernel']:<22} {row['us']:8.1f} us "
                  f"{row['gb_s']:6.0f} GB/s", flush=True)  # fmt: skip
        results += rows
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
