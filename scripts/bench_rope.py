"""RoPE over packed sequences: megatron-core's unfused THD path (what runs without TransformerEngine)
against agentrl's one-pass version (`agentrl/trainer/megatron/rope.py`), in the same process, on
the same tensors: operators per call (forward + backward), wall time per call, and whether the
results are bit-identical.

    python scripts/bench_rope.py                          # CPU, or CUDA when present
    python scripts/bench_rope.py --sequences 32 --tokens 4096 --heads 32 --dim 64

Needs megatron-core (extra `megatron`). Its THD path changed between versions (0.16 gathers the
frequencies once; 0.19 rotates one sequence at a time): the version is part of the output.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class _NoContextParallel:
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _inputs(args: argparse.Namespace, device: str):
    g = torch.Generator().manual_seed(0)
    lengths = [args.tokens // args.sequences] * args.sequences
    lengths[-1] += args.tokens - sum(lengths)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    t = torch.randn(args.tokens, args.heads, args.dim, generator=g).to(device, dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    inv = 1.0 / (10000 ** (torch.arange(0, args.dim, 2).float() / args.dim))
    freqs = torch.outer(torch.arange(max(lengths)).float(), inv)
    freqs = torch.cat([freqs, freqs], -1)[:, None, None, :]
    return t, cu.to(device), freqs.to(device)


def _call(fn, t, cu, freqs):
    x = t.detach().requires_grad_()
    out = fn(x, cu, freqs, cp_group=_NoContextParallel())
    out.float().sum().backward()
    return out.detach(), x.grad


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(name: str, fn, t, cu, freqs, device: str, repeats: int) -> dict:
    from torch.profiler import profile

    _call(fn, t, cu, freqs)  # warm-up
    with profile() as prof:
        _call(fn, t, cu, freqs)
    ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        _call(fn, t, cu, freqs)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return {"name": name, "aten_ops_per_call": ops, "ms_per_call": statistics.median(times) * 1e3}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequences", type=int, default=16, help="packed sequences per call")
    parser.add_argument("--tokens", type=int, default=4096, help="packed tokens per call")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/rope.json")
    args = parser.parse_args(argv)

    from agentrl.trainer.megatron import rope  # first: it imports megatron-core past a saver

    # isort: split
    import megatron.core

    device = "cuda" if torch.cuda.is_available() else "cpu"
    t, cu, freqs = _inputs(args, device)
    theirs, ours = (
        measure(name, fn, t, cu, freqs, device, args.repeats)
        for name, fn in (
            ("megatron-core THD (unfused)", rope._megatron_thd),
            ("agentrl one pass", rope.apply_rotary_pos_emb_thd),
        )
    )
    (a, ga), (b, gb) = (
        _call(rope._megatron_thd, t, cu, freqs),
        _call(rope.apply_rotary_pos_emb_thd, t, cu, freqs),
    )
    record = {
        "megatron_core": megatron.core.__version__,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "shape": vars(args),
        "results": [theirs, ours],
        "bit_identical": bool(torch.equal(a, b) and torch.equal(ga, gb)),
        "speedup": theirs["ms_per_call"] / ours["ms_per_call"],
    }
    print(f"megatron-core {record['megatron_core']} on {record['device']}: {args.sequences} "
          f"sequences, {args.tokens} tokens, {args.heads} heads x {args.dim}")  # fmt: skip
    for r in record["results"]:
        print(f"  {r['name']:<30}{r['aten_ops_per_call']:>8} aten ops{r['ms_per_call']:>9.3f} ms")
    print(f"  {record['speedup']:.2f}x faster; bit-identical: {record['bit_identical']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    _plot(record, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return record


def _plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in record["results"]]
    fig, axes = plt.subplots(1, 2, figsize=(8, 2.6))
    for ax, key, label in ((axes[0], "aten_ops_per_call", "aten ops per call"),
                           (axes[1], "ms_per_call", "ms per call (fwd + bwd)")):  # fmt: skip
        ax.barh(names, [r[key] for r in record["results"]], color=["tab:gray", "tab:blue"])
        ax.set_xlabel(label)
    axes[1].set_yticks([])
    fig.suptitle(f"packed RoPE, megatron-core {record['megatron_core']}, {record['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
