"""One SmolLM2-135M decoder layer's linears (q, k, v, o, gate, up, down) and the lm_head on CPU in
fp32: `F.linear` (MKL sgemm) against oneDNN on a prepacked weight (what `LocalEngine` uses on CPU,
agentrl/engine/local/cpu_linear.py), at decode and prefill row counts; milliseconds, lower quartile.

    nice -n 5 python benchmarks/engine_cpu/linear_microbench.py --threads 1
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
LM_HEAD = [(49152, 576)]


def lower_quartile_ms(fn: Callable[[], object], reps: int = 20) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[reps // 4]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", default="1,8,32,1024")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"{args.threads} thread(s); ms per call, summed over the matrices")
    for label, shapes in (("layer", LAYER), ("lm_head", LM_HEAD)):
        weights = [torch.randn(n, k) * 0.02 for n, k in shapes]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
        for rows in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(rows, k) for _, k in shapes]
            plain = sum(
                lower_quartile_ms(lambda x=x, w=w: F.linear(x, w))
                for x, w in zip(xs, weights, strict=True)
            )
            onednn = sum(
                lower_quartile_ms(
                    lambda x=x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                )
                for x, p in zip(xs, packed, strict=True)
            )
            print(f"{label:8s} rows {rows:5d}: F.linear {plain:8.2f}  oneDNN packed {onednn:8.2f}"
                  f"  ({plain / onednn:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
