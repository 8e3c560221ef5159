"""LocalEngine speed, in one run: (1) tok/s against transformers `generate()` (eager, no compile)
on the same random-init SmolLM2-shaped model, prompt 128 + 256 new tokens with EOS ignored, at
several batch sizes, and the fraction of the HBM roofline (weights + KV bytes read per decode step
over the measured copy bandwidth); (2) a multi-turn workload (each turn appends the reply and a
200-token observation) with and without prefix reuse: tok/s and tokens prefilled.

    python scripts/bench_engine.py --tokenizer .gpu/smollm2_tok            # GPU, bf16, full run
    python scripts/bench_engine.py --shapes smollm2-135m --batch-sizes 1,8 --new-tokens 32 \
        --dtype float32 --episodes 8 --turn-new-tokens 16                   # CPU, a few minutes
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import inspect
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from agentrl.engine.base import SamplingParams
from agentrl.engine.local import LocalEngine
from agentrl.model_store import make_shaped_model, resolve_model_path


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
    accepted = inspect.signature(LocalEngine).parameters
    options = {k: v for k, v in options.items() if k in accepted}  # older engines lack some
    engine = LocalEngine.load(
        path, device=args.device, dtype=args.dtype, max_batch_size=max_batch_size, **options
    )
    engine._stop_checker.eos_token_ids = set()  # EOS ignored, as the benchmark's spec says
    return engine


async def engine_run(engine: Any, prompts: list[list[int]], new_tokens: int) -> float:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    start = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, greedy) for p in prompts))
    elapsed = time.perf_counter() - start
    assert all(len(c.ids) == new_tokens for c in outs), "a request stopped early"
    return len(prompts) * new_tokens / elapsed


def replay_ms(engine: Any, batch: int) -> float | None:
    """GPU time of one decode-graph replay at this batch (the step without its host work)."""
    graphs = getattr(engine, "_graphs", None)
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


def hf_run(model: Any, prompts: list[list[int]], new_tokens: int, device: str) -> float:
    ids = torch.tensor(prompts, device=device)
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
    sync(device)
    assert out.shape[1] == ids.shape[1] + new_tokens
    return len(prompts) * new_tokens / (time.perf_counter() - start)


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


async def bench_shape(shape: str, args: argparse.Namespace, bw: float, work: Path) -> dict:
    from transformers import AutoModelForCausalLM

    path = str(work / shape)
    make_shaped_model(path, args.tokenizer, shape, dtype=args.dtype, device=args.device)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).to(
        args.device
    )
    cfg, dtype_bytes = hf.config, torch.finfo(getattr(torch, args.dtype)).bits // 8
    rows = []
    max_len = args.prompt_len + args.new_tokens + 8
    for batch in args.batch_sizes:
        prompts = random_prompts(batch, args.prompt_len, cfg.vocab_size, seed=batch)
        hf_run(hf, prompts[:1], 4, args.device)  # warm-up
        hf_tok_s = hf_run(hf, prompts, args.new_tokens, args.device)
        free_memory(args.device)  # generate()'s cache blocks go back before the arena is sized
        engine = make_engine(path, args, batch, max_context_len=max_len)
        await engine_run(engine, prompts, 8)  # warm-up (and CUDA graph capture)
        engine_tok_s = await engine_run(engine, prompts, args.new_tokens)
        stats, graph_step_ms = engine.stats, replay_ms(engine, batch)
        await engine.close()
        del engine
        free_memory(args.device)
        roof = roofline_tok_s(cfg, dtype_bytes, batch, args, bw)
        rows.append(
            {
                "batch": batch,
                "engine_tok_s": engine_tok_s,
                "hf_generate_tok_s": hf_tok_s,
                "speedup": engine_tok_s / hf_tok_s,
                "roofline_tok_s": roof,
                "roofline_fraction": engine_tok_s / roof,
                "graph_replays": getattr(stats, "num_graph_replays", 0),  # older engines lack it
                "mean_step_ms": 1000 * batch / engine_tok_s,
                "graph_step_ms": graph_step_ms,
            }
        )
        print(shape, rows[-1], flush=True)
    del hf
    free_memory(args.device)
    turn_len = args.prompt_len + args.turns * (args.turn_new_tokens + args.observation_len) + 8
    turns = {}
    for label, use_key in (("without_reuse", False), ("with_reuse", True)):
        engine = make_engine(path, args, args.episodes, max_context_len=turn_len)
        await engine_run(engine, random_prompts(2, args.prompt_len, cfg.vocab_size, 3), 4)
        turns[label] = await multi_turn(engine, args, cfg.vocab_size, use_key)
        print(shape, label, turns[label], flush=True)
        await engine.close()
        del engine
        free_memory(args.device)
    return {"shape": shape, "single_turn": rows, "multi_turn": turns}


def print_tables(results: list[dict], console: Console) -> None:
    table = Table(title="LocalEngine vs transformers generate() (greedy, EOS ignored)")
    for col in ("shape", "batch", "engine tok/s", "HF tok/s", "speedup", "roofline"):
        table.add_column(col, justify="right")
    for r in results:
        for row in r["single_turn"]:
            table.add_row(
                r["shape"],
                str(row["batch"]),
                f"{row['engine_tok_s']:,.0f}",
                f"{row['hf_generate_tok_s']:,.0f}",
                f"{row['speedup']:.2f}x",
                f"{100 * row['roofline_fraction']:.1f}%",
            )
    console.print(table)
    turns = Table(title="multi-turn episodes")
    for col in ("shape", "prefix reuse", "tok/s", "prefilled tokens", "cached tokens"):
        turns.add_column(col, justify="right")
    for r in results:
        for label, m in r["multi_turn"].items():
            turns.add_row(
                r["shape"],
                label,
                f"{m['tokens_per_s']:,.0f}",
                f"{m['prefilled']:,}",
                f"{m['cached']:,}",
            )
    console.print(turns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="smollm2-135m,smollm2-1.7b")
    parser.add_argument("--batch-sizes", default="1,64,128")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
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
    args.tokenizer = resolve_model_path(args.tokenizer)
    bw = copy_bandwidth_bytes_per_s(args.device)
    console = Console()
    console.print(f"device {args.device}, copy bandwidth {bw / 1e9:,.0f} GB/s, dtype {args.dtype}")
    with tempfile.TemporaryDirectory() as tmp:
        results = [asyncio.run(bench_shape(s, args, bw, Path(tmp))) for s in args.shapes.split(",")]
    print_tables(results, console)
    out = {"args": vars(args), "copy_bandwidth_bytes_per_s": bw, "results": results}
    if args.device.startswith("cuda"):
        out["device_name"] = torch.cuda.get_device_name()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
