"""BM25 retrieval throughput on the embedded search_r1 corpus, pinned to 2 cores: single and
batched queries, in-process and through `agentrl retriever serve` (HTTP), in one run.

Baseline: in-process, one query per call. Each mode gets its own slice of the generated
questions, so no mode is served from another's cache.

    python scripts/bench_retrieval.py [--num-queries 1000] [--batch-size 64] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from agentrl_envs.search_r1 import embedded
from agentrl_envs.search_r1.bm25 import BM25Index, BM25Retriever
from agentrl_envs.search_r1.http_client import HTTPRetriever
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

TOPK = 3
console = Console()


def main() -> None:
    args = parse_args()
    cores = pin_cores(args.cores)
    data = embedded.ensure_embedded()
    corpus = data / "corpus.jsonl"
    questions = [
        row["question"]
        for split in ("train", "dev", "test")
        for row in embedded.read_jsonl(data / f"{split}.jsonl")
    ]
    start = time.perf_counter()
    index = BM25Index.load_or_build(corpus)
    load_s = time.perf_counter() - start
    n, b = args.num_queries, args.batch_size
    slices = iter(questions[i * n : (i + 1) * n] for i in range(len(questions) // n))
    server, url = start_server(corpus, cores)
    try:
        modes = [
            ("in-process", "single", lambda qs: run_single(index.search, qs)),
            ("in-process", f"batch {b}", lambda qs: run_batched(index.search, qs, b)),
            (
                "in-process",
                f"{b} concurrent callers",
                lambda qs: asyncio.run(run_concurrent(BM25Retriever(corpus), qs, b)),
            ),
            ("http", "single", lambda qs: run_single(http_search(url), qs)),
            ("http", f"batch {b}", lambda qs: run_batched(http_search(url), qs, b)),
            (
                "http",
                f"{b} concurrent callers",
                lambda qs: asyncio.run(run_concurrent(HTTPRetriever(url, cache_size=0), qs, b)),
            ),
        ]
        rows = measure(modes, slices, n)
    finally:
        stop_server(server)
    report(rows, args, cores=cores, load_s=load_s, num_docs=len(index.documents))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-queries", type=int, default=1000, help="queries per mode")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--cores", type=int, default=2, help="CPU cores for this process and the server"
    )
    parser.add_argument("--out", default="benchmarks/retrieval.json")
    return parser.parse_args()


def pin_cores(num_cores: int) -> list[int]:
    cores = sorted(os.sched_getaffinity(0))[:num_cores]
    os.sched_setaffinity(0, cores)
    return cores


def start_server(corpus: Path, cores: list[int]) -> tuple[subprocess.Popen, str]:
    """The real `agentrl retriever serve` in a child process on a free 127.0.0.1 port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-c", "from agentrl.cli import main; main()", "retriever", "serve",
           "--corpus", str(corpus), "--port", str(port)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.sched_setaffinity(proc.pid, cores)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    stop_server(proc)
    raise SystemExit(f"`agentrl retriever serve` did not come up on {url}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def http_search(url: str) -> Callable[[list[str], int], list]:
    client = httpx.Client(timeout=60)

    def search(queries: list[str], topk: int) -> list:
        response = client.post(
            f"{url}/retrieve", json={"queries": queries, "topk": topk, "return_scores": True}
        )
        response.raise_for_status()
        return response.json()["result"]

    return search


def run_single(search: Callable[[list[str], int], list], queries: list[str]) -> None:
    for q in queries:
        search([q], TOPK)


def run_batched(
    search: Callable[[list[str], int], list], queries: list[str], batch_size: int
) -> None:
    for i in range(0, len(queries), batch_size):
        search(queries[i : i + batch_size], TOPK)


async def run_concurrent(retriever, queries: list[str], num_callers: int) -> None:
    """What concurrent episodes do: each caller searches one query at a time."""
    pending = iter(queries)

    async def caller() -> None:
        for q in pending:
            await retriever.search([q], TOPK)

    await retriever.search(["warm up"], TOPK)
    await asyncio.gather(*(caller() for _ in range(num_callers)))
    await retriever.close()


def measure(modes, slices, num_queries: int) -> list[dict]:
    rows = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("retrieval modes", total=len(modes))
        for path, shape, fn in modes:
            queries = next(slices)
            fn(queries[:20])  # warm up (JIT paths, connections)
            start = time.perf_counter()
            fn(queries)
            seconds = time.perf_counter() - start
            rows.append(
                {
                    "path": path,
                    "shape": shape,
                    "num_queries": num_queries,
                    "seconds": seconds,
                    "queries_per_s": num_queries / seconds,
                }
            )
            progress.advance(task)
    baseline = rows[0]["queries_per_s"]
    for row in rows:
        row["speedup_vs_baseline"] = row["queries_per_s"] / baseline
    return rows


def report(
    rows: list[dict], args: argparse.Namespace, *, cores: list[int], load_s: float, num_docs: int
) -> None:
    table = Table(
        title=f"BM25 (bm25s) on the embedded corpus: {num_docs} docs, top-{TOPK}, {len(cores)} cores"
    )
    for column in ("path", "queries", "queries/s", "vs in-process single"):
        table.add_column(column, justify="right" if column != "path" else "left")
    for row in rows:
        table.add_row(
            row["path"],
            row["shape"],
            f"{row['queries_per_s']:,.0f}",
            f"{row['speedup_vs_baseline']:.2f}x",
        )
    console.print(table)
    console.print(f"index load (cached on disk): {load_s:.2f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = {
        "cpu_cores_used": len(cores),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor(),
        "python": platform.python_version(),
    }
    out.write_text(json.dumps({"benchmark": "retrieval", "machine": machine, "num_documents": num_docs, "topk": TOPK,
                               "batch_size": args.batch_size, "index_load_s": load_s, "results": rows}, indent=2) + "\n")  # fmt: skip
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
