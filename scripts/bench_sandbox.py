"""Sandbox throughput: executions/s and p50/p99 latency of a trivial program per backend,
against a bare `subprocess.run` of the same program measured in the same run.

    python scripts/bench_sandbox.py --num-runs 100 --concurrency 2 --out benchmarks/sandbox.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from agentrl.tools.sandbox import Leases, Limits, Program, SandboxUnavailable, make_sandbox
from agentrl.tools.sandbox.bubblewrap import host_python

PROGRAM = "print(sum(range(100)))"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(name: str, latencies: list[float], wall_s: float, num_failed: int) -> dict:
    return {
        "backend": name,
        "num_runs": len(latencies),
        "num_failed": num_failed,
        "executions_per_s": len(latencies) / wall_s,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * percentile(latencies, 0.99),
    }


async def bench_bare(python: str, num_runs: int, concurrency: int, progress: Progress) -> dict:
    """The baseline: `subprocess.run([python, -c, PROGRAM])`, no isolation at all."""
    name = f"bare subprocess.run ({python})"
    task = progress.add_task(name, total=num_runs)
    sem = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one() -> None:
        async with sem:
            start = time.monotonic()
            await asyncio.to_thread(
                subprocess.run, [python, "-c", PROGRAM], capture_output=True, check=True
            )
            latencies.append(time.monotonic() - start)
            progress.advance(task)

    start = time.monotonic()
    await asyncio.gather(*(one() for _ in range(num_runs)))
    return summarize(name, latencies, time.monotonic() - start, 0)


async def bench_backend(
    name: str, num_runs: int, concurrency: int, progress: Progress
) -> dict | None:
    try:
        sandbox = make_sandbox(name, allow_unsafe=True, leases=Leases(concurrency))
    except SandboxUnavailable as e:
        progress.console.print(f"[yellow]{name}: skipped ({e})[/yellow]")
        return None
    await sandbox.run(Program(code=PROGRAM))  # warm-up (Docker starts its first container)
    task = progress.add_task(name, total=num_runs)
    latencies: list[float] = []
    num_failed = 0
    sem = asyncio.Semaphore(concurrency)  # same queueing as the baseline: latency excludes waiting

    async def one() -> None:
        nonlocal num_failed
        async with sem:
            start = time.monotonic()
            result = await sandbox.run(Program(code=PROGRAM), Limits(timeout_s=30))
            latencies.append(time.monotonic() - start)
            num_failed += not result.ok
            progress.advance(task)

    start = time.monotonic()
    await asyncio.gather(*(one() for _ in range(num_runs)))
    wall_s = time.monotonic() - start
    await sandbox.close()
    return summarize(name, latencies, wall_s, num_failed)


def interpreters() -> dict[str, str]:
    """backend -> the interpreter it runs, so each is compared with a bare run of the same one:
    bubblewrap calls the host's Python, the Docker image holds /usr/bin/python3, and the
    subprocess backend (as root) the system Python."""
    host, _ = host_python()
    system = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else host
    return {
        "bubblewrap": host,
        "docker": system,
        "subprocess": system if os.geteuid() == 0 else sys.executable,
    }


async def main(args: argparse.Namespace) -> list[dict]:
    rows = []
    pythons = interpreters()
    with Progress() as progress:
        for python in dict.fromkeys(pythons[b] for b in args.backends):
            rows.append(await bench_bare(python, args.num_runs, args.concurrency, progress))
        for name in args.backends:
            row = await bench_backend(name, args.num_runs, args.concurrency, progress)
            if row is not None:
                row["baseline"] = f"bare subprocess.run ({pythons[name]})"
                rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    by_name = {r["backend"]: r for r in rows}
    table = Table(title=f"sandbox: `{PROGRAM}` ({rows[0]['num_runs']} runs per backend)")
    for col in ("backend", "exec/s", "p50 ms", "p99 ms", "vs bare", "failed"):
        table.add_column(col, justify="right" if col != "backend" else "left")
    for r in rows:
        table.add_row(
            r["backend"],
            f"{r['executions_per_s']:.1f}",
            f"{r['p50_ms']:.1f}",
            f"{r['p99_ms']:.1f}",
            f"{r['executions_per_s'] / by_name[r.get('baseline', r['backend'])]['executions_per_s']:.2f}x",
            str(r["num_failed"]),
        )
    Console().print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-runs", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--backends", nargs="+", default=["bubblewrap", "docker", "subprocess"])
    parser.add_argument("--out", default="benchmarks/sandbox.json")
    args = parser.parse_args()
    rows = asyncio.run(main(args))
    print_table(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"program": PROGRAM, "concurrency": args.concurrency, "results": rows}, indent=2)
    )
    print(f"wrote {out}")
