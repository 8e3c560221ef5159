"""LocalEngine speed against transformers `generate()` as a user runs it, in one process.

On a random-init SmolLM2-shaped model (real tokenizer), prompt 128 + N new tokens, EOS ignored:
(1) prefill throughput (tokens/s over a batch of prompts totalling `--prefill-tokens`); (2) per
batch size, greedy and sampled, end-to-end and decode tokens/s of the engine and of each baseline:
`generate()` eager (dynamic cache) and `generate()` with `cache_implementation="static"` (which
transformers compiles with torch.compile on CUDA; on CPU it runs it uncompiled, as a user gets it).
Every runner is warmed up at the exact shape, then timed over `--repeats` rounds in which the
engine and the baselines alternate (a load change hits them alike); min and median are reported
and ratios come from medians; the JSON names the strongest baseline and the engine's ratio to it.
(3) a multi-turn workload (each turn appends the reply and an observation) with and without prefix
reuse. On CUDA also the fraction of the HBM roofline (weights + KV bytes read per decode step over
the measured copy bandwidth). Run it under `nice` on a shared machine; the CPU run takes ~20 min.

Why the old eager baseline ran 2.6-3.6x below a warmed `generate()` (issue 28): it was warmed
only at batch 1 for 4 tokens, so each timed call met its batch size and every longer KV length
for the first time inside the timing. Issue 28's table fits a fixed 11-13 s added to every
256-token call whatever the shape and batch (N/old - N/warm), i.e. per-shape first-use costs, not
per-step work; on CPU the old call (EOS kept, `min_new_tokens`, `inference_mode`) costs the same
per step as the plain call. `--baselines hf_eager,hf_static,hf_eager_old_call` times the old call
warmed too, to confirm this on a GPU.

    python scripts/bench_engine.py --tokenizer .gpu/smollm2_tok            # GPU, bf16, full run
    nice -n 5 python scripts/bench_engine.py --shapes smollm2-135m --batch-sizes 1,8,32 \
        --new-tokens 32 --dtype float32 --episodes 8 --turn-new-tokens 16 \
        --out benchmarks/bench_engine_cpu.json                              # CPU
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.support

from agentrl.engine.base import SamplingParams
from agentrl.engine.local import LocalEngine
from agentrl.model_store import resolve_model_path
from tests.support.random_models import make_shaped_model  # noqa: E402

MODES = {"greedy": 0.0, "sampled": 1.0}  # temperature; full vocabulary (no top-k/top-p) in both


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth_bytes_per_s(device: str) -> float:
    """Bytes read + written per second by a large device-to-device copy (the roofline's ceiling)."""
    numel = (1 << 28) if device.startswith("cuda") else (1 << 25)
    src = torch.empty(numel, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    start, reps = time.perf_counter(), 10
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * src.numel() * 4 * reps / (time.perf_counter() - start)


def free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, length), generator=g).tolist()


def make_engine(path: str, args: argparse.Namespace, max_batch_size: int, **options: Any) -> Any:
    # Not pausable: a benchmark never releases memory, and torch_memory_saver's allocator is not
    # what is measured here.
    engine = LocalEngine.load(path, device=args.device, dtype=args.dtype,
                              max_batch_size=max_batch_size, pausable_memory=False, **options)  # fmt: skip
    engine._stop_checker.eos_token_ids = set()  # EOS ignored, as the benchmark's spec says
    return engine


# ------------------------------------------------------------------ runners: one timed call each

Runner = Callable[[list[list[int]], int, float], float]
"""(prompts, new tokens, temperature) -> seconds for the whole batch."""


def engine_runner(engine: Any, loop: asyncio.AbstractEventLoop) -> Runner:
    def run(prompts: list[list[int]], new_tokens: int, temperature: float) -> float:
        sampling = SamplingParams(temperature=temperature, max_new_tokens=new_tokens, seed=0)

        async def all_of_them() -> list[Any]:
            return await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))

        start = time.perf_counter()
        outs = loop.run_until_complete(all_of_them())
        elapsed = time.perf_counter() - start
        assert all(len(c.ids) == new_tokens for c in outs), "a request stopped early"
        return elapsed

    return run


def hf_runner(model: Any, device: str, cache: str | None, old_call: bool = False) -> Runner:
    """`model.generate()` as a user calls it: the model's generation config with EOS turned off
    (no stop criterion, no logits processor: every row runs `new_tokens`), `cache` the
    `cache_implementation` ("static": transformers compiles the decode step on CUDA itself).
    `old_call`: as this script called it before issue 28 (EOS kept, `min_new_tokens` forcing the
    length through a logits processor, under `torch.inference_mode()`), to compare."""
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None
    config.cache_implementation = cache

    def run(prompts: list[list[int]], new_tokens: int, temperature: float) -> float:
        ids = torch.tensor(prompts, device=device)
        mode = dict(do_sample=temperature > 0, temperature=temperature or None)
        sync(device)
        start = time.perf_counter()
        if old_call:
            with torch.inference_mode():
                out = model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens, **mode,
                )  # fmt: skip
        else:  # transformers wants either a config or loose arguments: all of it on the config
            call = copy.copy(config)
            call.update(max_new_tokens=new_tokens, **mode)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=call)
        sync(device)
        elapsed = time.perf_counter() - start
        assert out.shape[1] == ids.shape[1] + new_tokens
        return elapsed

    return run


def timed(runners: dict[str, Runner], prompts: list[list[int]], lengths: tuple[int, ...],
          temperature: float, repeats: int) -> dict[str, dict[int, list[float]]]:  # fmt: skip
    """One warm-up call each at these exact shapes, then `repeats` rounds in which the runners
    alternate (each runs every length in turn). Returns seconds[runner][length][round]."""
    for run in runners.values():
        for n in lengths:
            run(prompts, n, temperature)
    seconds: dict[str, dict[int, list[float]]] = {
        name: {n: [] for n in lengths} for name in runners
    }
    for _ in range(repeats):
        for name, run in runners.items():
            for n in lengths:
                seconds[name][n].append(run(prompts, n, temperature))
    return seconds


def summary(tokens: int, seconds: list[float]) -> dict[str, float]:
    median = statistics.median(seconds)
    return {"min_s": min(seconds), "median_s": median, "tok_s": tokens / median,
            "best_tok_s": tokens / min(seconds)}  # fmt: skip


def compare(row: dict[str, Any], key: str = "tok_s") -> dict[str, Any]:
    """The strongest baseline of `row` by median tokens/s and the engine's ratios."""
    baselines = {k: v for k, v in row.items() if k != "engine"}
    strongest = max(baselines, key=lambda k: baselines[k][key])
    return {
        "strongest_baseline": strongest,
        "speedup_vs_strongest": row["engine"][key] / baselines[strongest][key],
        "speedup": {k: row["engine"][key] / v[key] for k, v in baselines.items()},
        "speedup_best_of_repeats": {
            k: row["engine"]["best_tok_s"] / v["best_tok_s"] for k, v in baselines.items()
        },
    }


def roofline_tok_s(cfg: Any, dtype_bytes: int, batch: int, args: argparse.Namespace, bw: float):
    """Tokens/s if each decode step only read the weights once and each row's KV once."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * dtype_bytes
    num_params = (
        cfg.num_hidden_layers
        * (
            cfg.hidden_size * head_dim * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
            + 3 * cfg.hidden_size * cfg.intermediate_size
        )
        + cfg.vocab_size * cfg.hidden_size
    )
    mean_context = args.prompt_len + args.new_tokens / 2
    bytes_per_step = num_params * dtype_bytes + batch * mean_context * kv_per_token
    return batch * bw / bytes_per_step


def single_turn(runners: dict[str, Runner], batch: int, vocab: int, args: argparse.Namespace):
    """Per mode: end-to-end tokens/s (N new tokens) and decode tokens/s (the N - 1 tokens after
    the first: per round, an N-token call less a 1-token call of the same runner; the median)."""
    prompts = random_prompts(batch, args.prompt_len, vocab, seed=batch)
    rows = {}
    for mode, temperature in MODES.items():
        if mode not in args.modes:
            continue
        n = args.new_tokens
        seconds = timed(runners, prompts, (n, 1), temperature, args.repeats)
        row: dict[str, Any] = {}
        for name, by_len in seconds.items():
            row[name] = summary(batch * n, by_len[n])
            decode_s = statistics.median(a - b for a, b in zip(by_len[n], by_len[1], strict=True))
            row[name]["decode_tok_s"] = batch * (n - 1) / decode_s if decode_s > 0 else 0.0
        rows[mode] = {"runners": row, **compare(row)}
        rows[mode]["decode_speedup_vs_strongest"] = compare(row, "decode_tok_s")[
            "speedup_vs_strongest"
        ]
        print(f"batch {batch} {mode}", json.dumps(rows[mode]), flush=True)
    return rows


async def multi_turn(engine: Any, args: argparse.Namespace, vocab: int, use_key: bool) -> dict:
    """Episodes of `turns` turns: each turn's input = the last input + reply + an observation."""
    sampling = SamplingParams(temperature=0.0, max_new_tokens=args.turn_new_tokens)
    prompts = random_prompts(args.episodes, args.prompt_len, vocab, seed=1)
    observations = random_prompts(args.episodes * args.turns, args.observation_len, vocab, seed=2)
    totals = {"generated": 0, "prefilled": 0, "cached": 0}

    async def episode(i: int) -> None:
        ids = list(prompts[i])
        for turn in range(args.turns):
            key = f"episode-{i}" if use_key else None
            c = await engine.generate(ids, sampling, routing_key=key)
            totals["generated"] += len(c.ids)
            totals["cached"] += c.cached_tokens
            totals["prefilled"] += len(ids) - c.cached_tokens
            ids = ids + c.ids + observations[i * args.turns + turn]

    start = time.perf_counter()
    await asyncio.gather(*(episode(i) for i in range(args.episodes)))
    elapsed = time.perf_counter() - start
    return {**totals, "seconds": elapsed, "tokens_per_s": totals["generated"] / elapsed}


HF_BASELINES: dict[str, dict[str, Any]] = {
    "hf_eager": {"cache": None},
    "hf_static": {"cache": "static"},
    "hf_eager_old_call": {"cache": None, "old_call": True},
}


def baselines(hf: Any, args: argparse.Namespace) -> dict[str, Runner]:
    return {name: hf_runner(hf, args.device, **HF_BASELINES[name]) for name in args.baselines}


def bench_shape(shape: str, args: argparse.Namespace, bw: float, work: Path) -> dict:
    from transformers import AutoModelForCausalLM

    path = str(work / shape)
    make_shaped_model(path, args.tokenizer, shape, dtype=args.dtype, device=args.device)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
    hf = hf.to(args.device).eval()
    cfg, dtype_bytes = hf.config, torch.finfo(getattr(torch, args.dtype)).bits // 8
    loop = asyncio.new_event_loop()
    result: dict[str, Any] = {"shape": shape}

    prefill_batch = max(1, args.prefill_tokens // args.prompt_len)
    engine = make_engine(path, args, prefill_batch, num_slots=prefill_batch,
                         max_context_len=args.prompt_len + 8)  # fmt: skip
    runners = {"engine": engine_runner(engine, loop), **baselines(hf, args)}
    prompts = random_prompts(prefill_batch, args.prompt_len, cfg.vocab_size, seed=0)
    seconds = {k: v[1] for k, v in timed(runners, prompts, (1,), 0.0, args.repeats).items()}
    tokens = prefill_batch * args.prompt_len
    result["prefill"] = {"batch": prefill_batch, "tokens": tokens,
                         **compare({k: summary(tokens, v) for k, v in seconds.items()}),
                         "runners": {k: summary(tokens, v) for k, v in seconds.items()}}  # fmt: skip
    print(shape, "prefill", json.dumps(result["prefill"]), flush=True)
    loop.run_until_complete(engine.close())
    del engine, runners
    free_memory(args.device)

    result["single_turn"] = []
    for batch in args.batch_sizes:
        engine = make_engine(path, args, batch, num_slots=batch,
                             max_context_len=args.prompt_len + args.new_tokens + 8)  # fmt: skip
        runners = {"engine": engine_runner(engine, loop), **baselines(hf, args)}
        rows = single_turn(runners, batch, cfg.vocab_size, args)
        roof = roofline_tok_s(cfg, dtype_bytes, batch, args, bw)
        engine_tok_s = rows[args.modes[0]]["runners"]["engine"]["tok_s"]
        result["single_turn"].append({
            "batch": batch, **rows, "roofline_tok_s": roof,
            "roofline_fraction": engine_tok_s / roof,
            "graph_replays": engine.stats.num_graph_replays,
            "graph_step_ms": replay_ms(engine, batch),
        })  # fmt: skip
        print(shape, "batch", batch, json.dumps(result["single_turn"][-1]), flush=True)
        loop.run_until_complete(engine.close())
        del engine, runners
        free_memory(args.device)
    del hf
    free_memory(args.device)
    result["multi_turn"] = multi_turns(path, args, cfg.vocab_size, loop)
    loop.close()
    return result


def multi_turns(path: str, args: argparse.Namespace, vocab: int, loop: Any) -> dict:
    turn_len = args.prompt_len + args.turns * (args.turn_new_tokens + args.observation_len) + 8
    turns = {}
    for label, use_key in (("without_reuse", False), ("with_reuse", True)):
        engine = make_engine(path, args, args.episodes, max_context_len=turn_len)
        engine_runner(engine, loop)(random_prompts(2, args.prompt_len, vocab, 3), 4, 0.0)
        turns[label] = loop.run_until_complete(multi_turn(engine, args, vocab, use_key))
        print(label, turns[label], flush=True)
        loop.run_until_complete(engine.close())
        del engine
        free_memory(args.device)
    return turns


def replay_ms(engine: Any, batch: int) -> float | None:
    """GPU time of one decode-graph replay at this batch (the step without its host work)."""
    graphs = engine._stepper.graphs
    if graphs is None:
        return None
    graph = graphs.graphs[min(b for b in graphs.buckets if b >= batch), False]
    graph.replay()  # after the run: its rows write only into slots nobody holds any more
    torch.cuda.synchronize()
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start) / reps


def print_tables(results: list[dict], console: Console) -> None:
    def ratio(x: float) -> str:
        return f"{x:.2f}x"

    for r in results:
        table = Table(title=f"{r['shape']}: tokens/s, median of the repeats (best in brackets)")
        # engine, hf_eager, ... as columns; "strongest" = the fastest baseline by median
        for col in ("run", "batch", *r["prefill"]["runners"], "strongest", "engine ÷ it"):
            table.add_column(col, justify="right")
        p = r["prefill"]
        table.add_row("prefill", str(p["batch"]), *(
            f"{v['tok_s']:,.0f} ({v['best_tok_s']:,.0f})" for v in p["runners"].values()
        ), p["strongest_baseline"], ratio(p["speedup_vs_strongest"]))  # fmt: skip
        for row in r["single_turn"]:
            for mode in MODES:
                if mode not in row:
                    continue
                m = row[mode]
                for label, key, speedup in (
                    (f"{mode} end-to-end", "tok_s", m["speedup_vs_strongest"]),
                    (f"{mode} decode", "decode_tok_s", m["decode_speedup_vs_strongest"]),
                ):
                    table.add_row(label, str(row["batch"]), *(
                        f"{v[key]:,.0f}" + (f" ({v['best_tok_s']:,.0f})" if key == "tok_s" else "")
                        for v in m["runners"].values()
                    ), m["strongest_baseline"], ratio(speedup))  # fmt: skip
        console.print(table)
        turns = Table(title=f"{r['shape']}: multi-turn episodes (engine)")
        for col in ("prefix reuse", "tok/s", "prefilled tokens", "cached tokens"):
            turns.add_column(col, justify="right")
        for label, m in r["multi_turn"].items():
            turns.add_row(label, f"{m['tokens_per_s']:,.0f}", f"{m['prefilled']:,}",
                          f"{m['cached']:,}")  # fmt: skip
        console.print(turns)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--shapes", default="smollm2-135m,smollm2-1.7b")
    parser.add_argument("--batch-sizes", default="1,64,128")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prefill-tokens", type=int, default=2048,
                        help="prefill: prompts of --prompt-len totalling this many tokens")  # fmt: skip
    parser.add_argument("--modes", default="greedy,sampled")
    parser.add_argument("--baselines", default="hf_eager,hf_static",
                        help="of hf_eager, hf_static, hf_eager_old_call")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds after a warm-up")
    parser.add_argument("--episodes", type=int, default=64, help="multi-turn: concurrent episodes")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--observation-len", type=int, default=200)
    parser.add_argument("--turn-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokenizer", default="smollm2-135m-instruct")
    parser.add_argument("--out", default="benchmarks/bench_engine.json")
    args = parser.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.modes = [m for m in args.modes.split(",") if m]
    args.baselines = [b for b in args.baselines.split(",") if b]
    for name, values, known in (("--modes", args.modes, MODES),
                                ("--baselines", args.baselines, HF_BASELINES)):  # fmt: skip
        if not values or not set(values) <= set(known):
            parser.error(f"{name}={','.join(values)}: pick from {', '.join(known)}")
    args.tokenizer = resolve_model_path(args.tokenizer)
    bw = copy_bandwidth_bytes_per_s(args.device)
    console = Console(width=max(Console().width, 150))
    console.print(
        f"device {args.device}, copy bandwidth {bw / 1e9:,.0f} GB/s, dtype {args.dtype}, "
        f"{torch.get_num_threads()} CPU threads"
    )
    with tempfile.TemporaryDirectory() as tmp:
        results = [bench_shape(s, args, bw, Path(tmp)) for s in args.shapes.split(",")]
    print_tables(results, console)
    out = {"args": vars(args), "copy_bandwidth_bytes_per_s": bw, "results": results,
           "torch_threads": torch.get_num_threads()}  # fmt: skip
    if args.device.startswith("cuda"):
        out["device_name"] = torch.cuda.get_device_name()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
