"""Where a LocalEngine decode step goes: kernels, GPU time by kernel, host gaps (issue 28).

On a random-init SmolLM2-shaped model (real tokenizer), per shape and batch size: prompts of
`--prompt-len` are prefilled, `--warmup` decode steps run (CUDA graph capture, compilation), then
`--steps` decode steps are (1) timed without a profiler, each step on its own, and (2) profiled
with torch.profiler. EOS is ignored. The engine's worker thread is stopped and its steps run in
this thread (the profile sees the host side; nothing else drives the engine meanwhile).

Per decode step it reports: wall ms (median of the timed steps; tokens/s = batch / that), the
kernel count, the summed kernel time, GPU busy time (the union of kernel intervals), the host gap
(wall minus kernel time: launch overhead, Python, syncs), the CUDA runtime calls by name (launches,
graph launches, synchronizations) and the top kernels by GPU time. On CPU "kernels" are top-level
operators (aten::, mkldnn::) and their time is their CPU time. `--baselines hf_static` profiles
transformers' static-cache `generate()` (compiled on CUDA by transformers) the same way: the
kernels of a call of 1 + `--steps` new tokens less those of a 1-token call. Each row is written
to `--out` as soon as it is measured; a runner that fails is recorded with its error.

    python scripts/profile_engine.py --tokenizer .gpu/smollm2_tok --shapes smollm2-135m \
        --out /tmp/prof135                            # GPU, bf16; one shape a call fits 10 minutes
    python scripts/profile_engine.py --device cpu --shapes smollm2-135m --batch-sizes 2 \
        --steps 4 --dtype float32 --out /tmp/prof                                   # CPU check

`--variant NAME:key=value,...` (repeatable) profiles the engine once per variant with those
constructor options; without it one "default". Before and after the fused/compiled path:

    python scripts/profile_engine.py --variant default: --variant nocompile:compile_decode=false \
        --variant unfused:fuse_projections=false,compile_decode=false --baselines hf_static
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import copy
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.support

from agentrl.engine.base import SamplingParams
from agentrl.engine.local import LocalEngine
from agentrl.engine.local.batching import Sequence
from agentrl.model_store import resolve_model_path
from tests.support.random_models import make_shaped_model  # noqa: E402

TOP = 15


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, length), generator=g).tolist()


# ------------------------------------------------------------------ the engine, stepped here


def open_engine(path: str, args: argparse.Namespace, batch: int, options: dict) -> LocalEngine:
    engine = LocalEngine.load(
        path, device=args.device, dtype=args.dtype, max_batch_size=batch, num_slots=batch,
        max_context_len=args.prompt_len + 2 * (args.warmup + args.steps) + 16, **options,
    )  # fmt: skip
    engine._stop_checker.eos_token_ids = set()  # EOS ignored
    # Stop the worker thread without closing the engine (close frees pausable memory): its steps
    # then run in this thread, where the profiler and the timer see them.
    engine._is_closed = True
    engine._wake.set()
    engine._thread.join()
    engine._is_closed = False
    return engine


def start_batch(engine: LocalEngine, prompts: list[list[int]], new_tokens: int) -> list[Sequence]:
    """Queue the prompts and step until each has its first token (the prefill steps)."""
    loop = asyncio.new_event_loop()
    sampling = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    seqs = [Sequence(list(p), sampling, loop.create_future(), loop, seed=i)
            for i, p in enumerate(prompts)]  # fmt: skip
    for seq in seqs:
        engine._scheduler.add(seq)
    while not all(s.output_ids for s in seqs):
        engine._step()
    return seqs


def drain(engine: LocalEngine) -> None:
    while engine._scheduler.has_work() or engine._stepper.in_flight is not None:
        engine._step()
    sync(engine.device)


def decode_steps(engine: LocalEngine, n: int) -> list[float]:
    """Run `n` decode steps; seconds of each (`_step` returns once a step's tokens are checked)."""
    before, times = engine.stats.num_decode_steps, []
    for _ in range(n):
        start = time.perf_counter()
        engine._step()
        times.append(time.perf_counter() - start)
    if engine.stats.num_decode_steps - before != n:
        raise RuntimeError(
            f"expected {n} decode steps, the engine counted {engine.stats.num_decode_steps - before}"
        )
    return times


def profile_engine(engine: LocalEngine, prompts: list[list[int]], args: argparse.Namespace):
    total = args.warmup + args.steps + 2
    start = time.perf_counter()
    start_batch(engine, prompts, total)
    decode_steps(engine, args.warmup)  # the first decode step captures the graphs (and compiles)
    sync(args.device)
    warmup_s = time.perf_counter() - start
    wall = decode_steps(engine, args.steps)
    drain(engine)
    start_batch(engine, prompts, total)
    decode_steps(engine, args.warmup)
    sync(args.device)  # the step in flight finishes outside the window
    with profile(activities=activities(args.device)) as prof:
        decode_steps(engine, args.steps)
        sync(args.device)  # the step launched last finishes inside it: `steps` steps' kernels
    drain(engine)
    stats = kernel_stats(prof.events(), args.device, args.steps)
    stepper, fused = engine._stepper, engine.fused
    stats.update(
        graph_replays=engine.stats.num_graph_replays, warmup_s=warmup_s,
        fused=fused is not None, compiled=bool(fused and fused.is_compiled),
        graphs=stepper.graphs is not None,
        sampler_eager=sorted(stepper.graphs._eager_sampling) if stepper.graphs else None,
    )  # fmt: skip
    return {**wall_stats(wall, len(prompts)), **stats}


# ------------------------------------------------------------------ transformers' static cache


def profile_hf_static(model: Any, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Decode of `generate(cache_implementation="static")`: (1 + steps)-token call less 1 token."""
    config = copy.deepcopy(model.generation_config)
    config.update(eos_token_id=None, cache_implementation="static", do_sample=False)
    ids = torch.tensor(prompts, device=args.device)

    def call(new_tokens: int) -> float:
        run = copy.copy(config)
        run.update(max_new_tokens=new_tokens)
        sync(args.device)
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=run)
        sync(args.device)
        return time.perf_counter() - start

    n = args.steps + 1
    for _ in range(2):  # compile and warm both lengths
        call(n), call(1)
    long, short = [call(n) for _ in range(3)], [call(1) for _ in range(3)]
    per_step = (statistics.median(long) - statistics.median(short)) / args.steps
    profiles = []
    for new_tokens in (n, 1):
        with profile(activities=activities(args.device)) as prof:
            call(new_tokens)
        profiles.append(prof.events())
    stats = kernel_stats(profiles[0], args.device, args.steps, minus=profiles[1])
    return {**wall_stats([per_step], len(prompts)), **stats}


# ------------------------------------------------------------------ what the profiles say


def activities(device: str) -> list[ProfilerActivity]:
    if device.startswith("cuda"):
        return [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    return [ProfilerActivity.CPU]


def wall_stats(seconds: list[float], batch: int) -> dict[str, float]:
    median = statistics.median(seconds)
    return {"step_ms": 1000 * median, "step_ms_mean": 1000 * statistics.mean(seconds),
            "step_ms_min": 1000 * min(seconds), "tok_s": batch / median}  # fmt: skip


def _kernels(events: Any, device: str) -> list[tuple[str, float, float, float]]:
    """(name, us, start us, end us) of every device kernel / memcpy / memset (CUDA) or every
    top-level aten operator (CPU: its CPU time, nested operators included)."""
    out = []
    for e in events:
        if device.startswith("cuda"):
            if e.device_type == DeviceType.CUDA:
                out.append(
                    (e.name, e.time_range.elapsed_us(), e.time_range.start, e.time_range.end)
                )
        elif "::" in e.name and not _has_op_parent(e):  # aten::, mkldnn:: (packed linears)
            out.append((e.name, e.cpu_time_total, e.time_range.start, e.time_range.end))
    return out


def _has_op_parent(e: Any) -> bool:
    parent = e.cpu_parent
    while parent is not None:
        if "::" in parent.name:
            return True
        parent = parent.cpu_parent
    return False


def _runtime_calls(events: Any) -> Counter[str]:
    return Counter(e.name for e in events
                   if e.device_type == DeviceType.CPU and e.name.startswith("cuda"))  # fmt: skip


def _busy_us(kernels: list[tuple[str, float, float, float]]) -> float:
    """Length of the union of the kernels' intervals (time the device did anything)."""
    busy, end = 0.0, float("-inf")
    for _, _, start, stop in sorted(kernels, key=lambda k: k[2]):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def kernel_stats(events: Any, device: str, steps: int, minus: Any = None) -> dict[str, Any]:
    """Per-step kernel figures of `events` (less those of `minus`, a shorter run's profile)."""
    kernels = _kernels(events, device)
    dropped = _kernels(minus, device) if minus is not None else []
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # count, us
    for kernel_list, sign in ((kernels, 1), (dropped, -1)):
        for name, us, _, _ in kernel_list:
            by_name[name][0] += sign
            by_name[name][1] += sign * us
    total_us = sum(us for _, us in by_name.values())
    busy_us = _busy_us(kernels) - _busy_us(dropped)
    calls = _runtime_calls(events)
    if minus is not None:
        calls.subtract(_runtime_calls(minus))
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:TOP]
    return {
        "kernels_per_step": sum(c for c, _ in by_name.values()) / steps,
        "kernel_ms_per_step": total_us / 1000 / steps,
        "busy_ms_per_step": busy_us / 1000 / steps,
        "runtime_calls_per_step": {k: v / steps for k, v in calls.most_common() if v},
        "top_kernels": [
            {
                "name": name,
                "per_step": c / steps,
                "ms_per_step": us / 1000 / steps,
                "share": us / total_us if total_us else 0.0,
            }
            for name, (c, us) in top
        ],  # fmt: skip
    }


def with_gap(stats: dict[str, Any]) -> dict[str, Any]:
    stats["host_gap_ms_per_step"] = stats["step_ms"] - stats["kernel_ms_per_step"]
    stats["idle_ms_per_step"] = stats["step_ms"] - stats["busy_ms_per_step"]
    return stats


# ------------------------------------------------------------------ driver


def parse_variants(specs: list[str]) -> dict[str, dict[str, Any]]:
    """`name:key=value,key=value` -> {name: {key: value}} (values as Python literals or
    true/false)."""
    variants: dict[str, dict[str, Any]] = {}
    for spec in specs or ["default:"]:
        name, _, rest = spec.partition(":")
        options = {}
        for item in filter(None, rest.split(",")):
            key, _, raw = item.partition("=")
            text = {"true": "True", "false": "False"}.get(raw.lower(), raw)
            try:
                options[key] = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                options[key] = raw
        variants[name or "default"] = options
    return variants


def profile_shape(shape: str, args: argparse.Namespace, work: Path, report: Report) -> None:
    path = make_shaped_model(str(work / shape), args.tokenizer, shape, dtype=args.dtype,
                             device=args.device)  # fmt: skip
    for batch in args.batch_sizes:
        for name, options in args.variants.items():
            with report.row(shape, batch, f"engine:{name}", options=options) as row:
                engine = open_engine(path, args, batch, options)
                try:
                    prompts = random_prompts(batch, args.prompt_len, engine._vocab_size, batch)
                    row.update(with_gap(profile_engine(engine, prompts, args)))
                finally:
                    asyncio.run(engine.close())
                    del engine
                    free(args.device)
        if "hf_static" in args.baselines:
            with report.row(shape, batch, "hf_static") as row:
                from transformers import AutoModelForCausalLM

                hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
                hf = hf.to(args.device).eval()
                try:
                    prompts = random_prompts(batch, args.prompt_len, hf.config.vocab_size, batch)
                    row.update(with_gap(profile_hf_static(hf, prompts, args)))
                finally:
                    del hf
                    free(args.device)


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


class Report:
    """The rows so far, written to `out` after each one (a run cut short keeps what it did)."""

    def __init__(self, out: Path, header: str, args: argparse.Namespace, device_name: str):
        self.out, self.header, self.rows = out, header, []
        self.meta = {"args": vars(args), "device_name": device_name, "torch": torch.__version__}
        out.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def row(self, shape: str, batch: int, runner: str, **extra: Any) -> Iterator[dict]:
        """A row to fill; a failure is recorded in it (and printed) and the run goes on."""
        row: dict[str, Any] = {"shape": shape, "batch": batch, "runner": runner, **extra}
        try:
            yield row
        except Exception as e:  # one runner failing must not lose the others' figures
            traceback.print_exc()
            row["error"] = repr(e)
        self.rows.append(row)
        print(summary_line(row), flush=True)
        self.save()

    def save(self) -> None:
        (self.out / "profile_engine.json").write_text(
            json.dumps({**self.meta, "rows": self.rows}, indent=2)
        )
        (self.out / "profile_engine.txt").write_text(text_report(self.rows, self.header))


def summary_line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['shape']:>14} b={r['batch']:<4} {r['runner']:<22} FAILED: {r['error']}"
    return (
        f"{r['shape']:>14} b={r['batch']:<4} {r['runner']:<22} step {r['step_ms']:8.3f} ms "
        f"({r['tok_s']:10,.0f} tok/s)  kernels {r['kernels_per_step']:7.1f}  "
        f"kernel {r['kernel_ms_per_step']:7.3f} ms  busy {r['busy_ms_per_step']:7.3f} ms  "
        f"host gap {r['host_gap_ms_per_step']:7.3f} ms"
        + (f"  [fused {r['fused']}, compiled {r['compiled']}, graphs {r['graphs']}, "
           f"warm-up {r['warmup_s']:.1f} s]" if "fused" in r else "")
    )  # fmt: skip


def text_report(rows: list[dict[str, Any]], header: str) -> str:
    lines = [header, ""]
    lines += [summary_line(r) for r in rows]
    for r in (r for r in rows if "error" not in r):
        lines += ["", f"{r['shape']} batch {r['batch']} {r['runner']}: top kernels by time",
                  f"  {'per step':>8} {'ms/step':>8} {'share':>6}  name"]  # fmt: skip
        for k in r["top_kernels"]:
            lines.append(f"  {k['per_step']:8.1f} {k['ms_per_step']:8.4f} {k['share']:6.1%}  "
                         f"{k['name'][:110]}")  # fmt: skip
        calls = ", ".join(f"{n} {c:.1f}" for n, c in r["runtime_calls_per_step"].items())
        if calls:
            lines.append(f"  runtime calls per step: {calls}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--shapes", default="smollm2-135m,smollm2-1.7b")
    parser.add_argument("--batch-sizes", default="1,64,128")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed and profiled")
    parser.add_argument("--warmup", type=int, default=8, help="decode steps before them")
    parser.add_argument("--variant", action="append", dest="variants", default=[],
                        help="NAME:key=value,... engine constructor options (repeatable)")  # fmt: skip
    parser.add_argument("--baselines", default="", help="'hf_static' or empty")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokenizer", default="smollm2-135m-instruct")
    parser.add_argument("--out", default="/tmp/profile_engine")
    args = parser.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.baselines = [b for b in args.baselines.split(",") if b]
    if not set(args.baselines) <= {"hf_static"}:
        parser.error(f"--baselines={','.join(args.baselines)}: only hf_static is known")
    if args.steps < 1 or args.warmup < 1:
        parser.error(f"--steps={args.steps} and --warmup={args.warmup} must be at least 1")
    args.variants = parse_variants(args.variants)
    args.tokenizer = resolve_model_path(args.tokenizer)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    header = (f"device {args.device} ({device_name}), torch {torch.__version__}, dtype "
              f"{args.dtype}, prompt {args.prompt_len}, {args.steps} steps after {args.warmup}")  # fmt: skip
    print(header, flush=True)
    report = Report(Path(args.out), header, args, device_name)
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            profile_shape(shape, args, Path(tmp), report)
    print(text_report(report.rows, header))
    print(f"wrote {report.out / 'profile_engine.json'} and {report.out / 'profile_engine.txt'}")


if __name__ == "__main__":
    main()
