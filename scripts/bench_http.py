"""Tokens/s through SGLangEngine + `agentrl serve` (a separate process, real HTTP) versus the
in-process LocalEngine on the same model and prompts, and the HTTP overhead per request (µs).

    python scripts/bench_http.py --model smollm2-135m-instruct --num-prompts 32 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_prompts import build_prompts  # noqa: E402

from agentrl.engine.base import Engine, SamplingParams  # noqa: E402
from agentrl.engine.local import LocalEngine  # noqa: E402
from agentrl.engine.sglang import SGLangEngine  # noqa: E402
from agentrl.engine.sglang.protocol import completion_from_sglang  # noqa: E402
from tests.support.servers import serve_subprocess  # noqa: E402


async def throughput(
    engine: Engine,
    prompts: list[list[int]],
    max_new_tokens: int,
    concurrency: int,
    progress: Progress,
    label: str,
) -> dict[str, float | list[list[int]]]:
    limit = asyncio.Semaphore(concurrency)
    task = progress.add_task(label, total=len(prompts))

    async def one(i: int, prompt: list[int]):
        async with limit:
            c = await engine.generate(
                prompt, SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=i)
            )
            progress.advance(task)
            return c

    start = time.perf_counter()
    completions = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(c.ids) for c in completions)
    return {
        "tokens": num_tokens,
        "seconds": elapsed,
        "tokens_per_s": num_tokens / elapsed,
        "ids": [c.ids for c in completions],
    }


async def overhead_us(http: SGLangEngine, prompt: list[int], num_calls: int) -> float:
    """Median (client wall time - server's own meta_info.e2e_latency) of one /generate: the cost
    of HTTP, JSON both ways and parsing, without the model time (immune to its noise)."""
    payload = {
        "input_ids": prompt,
        "sampling_params": SamplingParams(temperature=0.0, max_new_tokens=1).to_sglang(),
        "return_logprob": True,
    }
    samples = []
    for _ in range(num_calls):
        start = time.perf_counter()
        response = await http._request("POST", f"{http.base_url}/generate", json=payload)
        out = response.json()
        completion_from_sglang(out)
        samples.append((time.perf_counter() - start - out["meta_info"]["e2e_latency"]) * 1e6)
    return statistics.median(samples)


async def latency_us(call, num_calls: int) -> float:
    """Median wall time of one awaited call, sequentially (no batching)."""
    samples = []
    for _ in range(num_calls):
        start = time.perf_counter()
        await call()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


async def run(args: argparse.Namespace) -> dict:
    console = Console()
    local = LocalEngine.load(args.model, device=args.device, seed=0)
    prompts = build_prompts(local.tokenizer, args.num_prompts)
    log_path = Path(args.out).with_suffix(".server.log")
    with serve_subprocess(local.model_path, log_path, device=args.device) as url:
        return await measure(args, console, local, prompts, url)


async def measure(args, console, local, prompts, url) -> dict:
    http = SGLangEngine(url, max_connections=args.concurrency)
    try:
        short = prompts[0][:8]
        one_token = SamplingParams(temperature=0.0, max_new_tokens=1)
        for engine in (local, http):  # warm up both paths
            await engine.generate(short, one_token)
        with Progress(console=console) as progress:
            base = await throughput(
                local, prompts, args.max_new_tokens, args.concurrency, progress, "in-process"
            )
            over = await throughput(
                http, prompts, args.max_new_tokens, args.concurrency, progress, "HTTP"
            )
        local_us = await latency_us(
            lambda: local.generate(short, one_token), args.num_latency_calls
        )
        http_us = await latency_us(lambda: http.generate(short, one_token), args.num_latency_calls)
        ping_us = await latency_us(http.get_weight_version, args.num_latency_calls)
        http_overhead_us = await overhead_us(http, short, args.num_latency_calls)
    finally:
        await http.close()
        await local.close()
    same = sum(a == b for a, b in zip(base["ids"], over["ids"], strict=True))
    result = {
        "model": local.model_path,
        "device": args.device,
        "num_prompts": args.num_prompts,
        "max_new_tokens": args.max_new_tokens,
        "concurrency": args.concurrency,
        "in_process": {k: v for k, v in base.items() if k != "ids"},
        "http": {k: v for k, v in over.items() if k != "ids"},
        "http_vs_in_process_throughput": over["tokens_per_s"] / base["tokens_per_s"],
        "identical_completions": f"{same}/{len(prompts)}",
        "one_token_generate_us": {"in_process": local_us, "http": http_us},
        "http_overhead_per_request_us": http_overhead_us,
        "http_round_trip_no_model_us": ping_us,
    }
    table = Table(title=f"bench_http: {Path(local.model_path).name} on {args.device}")
    for column in ("path", "tokens", "seconds", "tokens/s", "1-token generate (µs)"):
        table.add_column(column, justify="right")
    table.add_row(
        "in-process",
        str(base["tokens"]),
        f"{base['seconds']:.2f}",
        f"{base['tokens_per_s']:.1f}",
        f"{local_us:.0f}",
    )
    table.add_row(
        "SGLangEngine + serve",
        str(over["tokens"]),
        f"{over['seconds']:.2f}",
        f"{over['tokens_per_s']:.1f}",
        f"{http_us:.0f}",
    )
    console.print(table)
    console.print(
        f"HTTP overhead per request: {http_overhead_us:.0f} µs (client wall time minus the server's "
        f"e2e_latency; a GET round trip: {ping_us:.0f} µs); throughput ratio "
        f"{result['http_vs_in_process_throughput']:.2f}; identical completions {result['identical_completions']}"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-latency-calls", type=int, default=50)
    parser.add_argument("--out", default="benchmarks/bench_http.json")
    args = parser.parse_args()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup that stops the server
    result = asyncio.run(run(args))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
