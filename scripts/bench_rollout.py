"""Rollout benchmark, in one run: (1) LocalEngine tokens/s on CPU at batch 1 and 16 against plain
`model.generate` on the same model and prompts (greedy, so both produce the same tokens);
(2) per-turn orchestration overhead of `run_groups` at 256 concurrent episodes with an engine
that answers instantly, on a minimal in-loop env (the rollout layer alone) and on the real
calculator env (tool registry included), each against driving the env alone.

    python scripts/bench_rollout.py                    # SmolLM2-135M, ~3 min on 2 busy cores
    python scripts/bench_rollout.py --skip-engine      # overhead only, ~20 s
    python scripts/bench_rollout.py --max-new-tokens 128 --batch-size 32 --episodes 1024
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_prompts import build_prompts  # noqa: E402

from agentrl.config import RolloutConfig  # noqa: E402
from agentrl.engine.base import Completion, FinishReason, SamplingParams  # noqa: E402
from agentrl.envs import AgentEnv, StepResult, make  # noqa: E402
from agentrl.rollout import ChatCodec, RolloutRunner  # noqa: E402
from agentrl.types import Message, Task  # noqa: E402

# ---------------------------------------------------------------- (1) engine tokens/s


async def engine_tokens_per_s(
    engine: Any, prompts: list[list[int]], concurrency: int, max_new_tokens: int
) -> dict:
    limit = asyncio.Semaphore(concurrency)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)

    async def one(prompt: list[int]) -> Completion:
        async with limit:
            return await engine.generate(prompt, greedy)

    start = time.perf_counter()
    completions = await asyncio.gather(*(one(p) for p in prompts))
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(c.ids) for c in completions)
    return {"tokens": num_tokens, "seconds": elapsed, "tokens_per_s": num_tokens / elapsed}


def generate_tokens_per_s(
    model: Any, tokenizer: Any, prompts: list[list[int]], batch_size: int, max_new_tokens: int
) -> dict:
    """Plain `model.generate` on left-padded batches; counts tokens up to and including EOS
    per row (the padding a static batch keeps decoding is its cost, not its output)."""
    import torch

    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    num_tokens, start = 0, time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        batch = prompts[b : b + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        for row in out[:, width:].tolist():
            num_tokens += (
                row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
            )
    elapsed = time.perf_counter() - start
    return {"tokens": num_tokens, "seconds": elapsed, "tokens_per_s": num_tokens / elapsed}


async def bench_engine(args: argparse.Namespace, console: Console) -> list[dict]:
    import torch

    from agentrl.engine.local import LocalEngine

    torch.set_num_threads(args.threads)
    with console.status(f"loading {args.model}"):
        engine = LocalEngine.load(
            args.model, device="cpu", dtype="float32", max_batch_size=args.batch_size, seed=0
        )
    rows = []
    try:
        with Progress(console=console) as progress:
            task = progress.add_task("engine tokens/s", total=4)
            for batch, num_prompts in (
                (1, args.num_prompts_b1),
                (args.batch_size, args.batch_size),
            ):
                prompts = build_prompts(engine.tokenizer, num_prompts)
                # warm-up both paths at this batch size (thread pools, allocator) before timing
                await engine_tokens_per_s(engine, prompts, batch, 4)
                generate_tokens_per_s(engine.model, engine.tokenizer, prompts[:batch], batch, 4)
                local = await engine_tokens_per_s(engine, prompts, batch, args.max_new_tokens)
                progress.advance(task)
                plain = generate_tokens_per_s(
                    engine.model, engine.tokenizer, prompts, batch, args.max_new_tokens
                )
                progress.advance(task)
                rows.append(
                    {
                        "batch": batch,
                        "num_prompts": num_prompts,
                        "local_engine": local,
                        "model_generate": plain,
                    }
                )
    finally:
        await engine.close()
    return rows


# ---------------------------------------------------------------- (2) orchestration overhead


class InstantEngine:
    """Answers every request at once with pre-tokenized replies (3 tool calls, then an answer),
    and records when each episode's requests arrive and return."""

    weight_version = 0

    def __init__(self, tokenizer: Any, replies: list[str]) -> None:
        self.tokenizer = tokenizer
        self.replies = [
            tokenizer.encode(r, add_special_tokens=False) + [tokenizer.eos_token_id]
            for r in replies
        ]
        self.num_calls: dict[str, int] = defaultdict(int)
        self.returned_at: dict[str, float] = {}
        self.gaps_s: list[float] = []

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, routing_key: str | None = None
    ) -> Completion:
        now = time.perf_counter()
        key = routing_key or ""
        if key in self.returned_at:
            self.gaps_s.append(now - self.returned_at[key])
        await asyncio.sleep(0)  # a real engine call always yields to the event loop once
        ids = self.replies[min(self.num_calls[key], len(self.replies) - 1)]
        self.num_calls[key] += 1
        self.returned_at[key] = time.perf_counter()
        return Completion(list(ids), [0.0] * len(ids), FinishReason.STOP, self.weight_version)


REPLIES = [
    '<tool_call>\n{"name": "calculate", "arguments": {"expression": "17 + 25"}}\n</tool_call>',
    '<tool_call>\n{"name": "calculate", "arguments": {"expression": "42 * 3"}}\n</tool_call>',
    '<tool_call>\n{"name": "calculate", "arguments": {"expression": "126 - 6"}}\n</tool_call>',
    "The total is 120. <answer>120</answer>",
]


class EchoEnv(AgentEnv):
    """The thinnest env: every tool call is answered at once, in-loop (no registry, no thread),
    so a run measures the rollout layer alone. An answer ends the episode."""

    async def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        task = (options or {})["task"]
        return [Message("system", "Use the tools."), Message("user", task.data["question"])], {}

    async def step(self, action: Message) -> StepResult:
        if action.tool_calls:
            replies = [
                Message("tool", "42", tool_call_id=c.id, name=c.name) for c in action.tool_calls
            ]
            return StepResult(replies, info={"num_tool_calls": len(replies), "num_tool_errors": 0})
        return StepResult(reward=1.0, terminated=True)


ENVS: dict[str, Callable[[], AgentEnv]] = {
    "echo": EchoEnv,
    "calculator": lambda: make("calculator"),
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def overhead_run(
    tokenizer: Any, env_name: str, tasks: list[Task], n: int, concurrency: int
) -> dict:
    engine = InstantEngine(tokenizer, REPLIES)
    cfg = RolloutConfig(
        max_turns=len(REPLIES), max_concurrent_episodes=concurrency, rollout_max_context_len=8192
    )
    runner = RolloutRunner(engine, ENVS[env_name], cfg, codec=ChatCodec(tokenizer))  # type: ignore[arg-type]
    await runner.run_group(tasks[0], 1)  # codec check and warm caches outside the timing
    engine.gaps_s.clear()
    start = time.perf_counter()
    groups = await runner.run_groups(tasks, n)
    elapsed = time.perf_counter() - start
    num_turns = sum(t.num_turns for g in groups for t in g)
    gaps_us = [g * 1e6 for g in engine.gaps_s]
    return {
        "env": env_name,
        "episodes": len(tasks) * n,
        "concurrency": concurrency,
        "turns": num_turns,
        "seconds": elapsed,
        "us_per_turn": elapsed * 1e6 / num_turns,
        "gap_p50_us": percentile(gaps_us, 0.5),
        "gap_p99_us": percentile(gaps_us, 0.99),
        "completed": sum(t.status.value == "completed" for g in groups for t in g),
    }


async def env_alone(env_name: str, tasks: list[Task], n: int) -> dict:
    """Baseline: the same env and actions driven directly, no codec, engine or trajectory."""
    from agentrl.rollout.tool_parser import parse_hermes

    actions = [parse_hermes(r) for r in REPLIES]
    num_turns, start = 0, time.perf_counter()
    for task in tasks:
        for _ in range(n):
            env = ENVS[env_name]()
            await env.reset(options={"task": task})
            for action in actions:
                await env.step(action)
                num_turns += 1
            await env.close()
    elapsed = time.perf_counter() - start
    return {
        "env": env_name,
        "episodes": len(tasks) * n,
        "turns": num_turns,
        "seconds": elapsed,
        "us_per_turn": elapsed * 1e6 / num_turns,
    }


async def bench_overhead(args: argparse.Namespace, tokenizer: Any) -> dict:
    from agentrl.envs.builtin.calculator import CalculatorEnv

    n = 4
    tasks = CalculatorEnv.load_tasks("train", num_tasks=max(args.episodes // n, 1))
    few = tasks[: max(len(tasks) // 8, 1)]
    result: dict[str, Any] = {}
    for env_name in ENVS:
        r = {
            "concurrent": await overhead_run(tokenizer, env_name, tasks, n, args.episodes),
            "sequential": await overhead_run(tokenizer, env_name, few, n, 1),
            "env_alone": await env_alone(env_name, few, n),
        }
        # what the rollout layer (codec, engine call, trajectory) adds to each turn over the env
        r["rollout_layer_us_per_turn"] = (
            r["sequential"]["us_per_turn"] - r["env_alone"]["us_per_turn"]
        )
        result[env_name] = r
    return result


# ---------------------------------------------------------------- report


def report(result: dict, console: Console) -> None:
    if result.get("engine"):
        table = Table(
            title=f"LocalEngine vs model.generate, CPU, greedy, {result['args']['max_new_tokens']} new tokens"
        )
        for col in ("batch", "prompts", "LocalEngine tok/s", "model.generate tok/s", "ratio"):
            table.add_column(col, justify="right")
        for row in result["engine"]:
            local, plain = (
                row["local_engine"]["tokens_per_s"],
                row["model_generate"]["tokens_per_s"],
            )
            table.add_row(
                str(row["batch"]),
                str(row["num_prompts"]),
                f"{local:.1f}",
                f"{plain:.1f}",
                f"{local / plain:.2f}x",
            )
        console.print(table)
    table = Table(title="Orchestration overhead per turn (instant engine, 4 turns per episode)")
    for col in ("env", "run", "episodes", "conc.", "µs/turn", "gap p50 µs", "gap p99 µs"):
        table.add_column(col, justify="right")
    for env_name, o in result["overhead"].items():
        for name in ("concurrent", "sequential"):
            r = o[name]
            table.add_row(
                env_name,
                {"concurrent": "parallel", "sequential": "serial"}[name],
                str(r["episodes"]),
                str(r["concurrency"]),
                f"{r['us_per_turn']:.0f}",
                f"{r['gap_p50_us']:.0f}",
                f"{r['gap_p99_us']:.0f}",
            )
        b = o["env_alone"]
        table.add_row(
            env_name, "env alone", str(b["episodes"]), "1", f"{b['us_per_turn']:.0f}", "-", "-"
        )
    console.print(table)
    layer = ", ".join(
        f"{k} {o['rollout_layer_us_per_turn']:.0f}" for k, o in result["overhead"].items()
    )
    console.print(
        "µs/turn = wall time / turns. gap = time from an engine reply to the same episode's next "
        "request (parse, env.step, observation render; when concurrent, also the wait for the "
        f"other episodes' work). Rollout layer over the env alone, µs/turn: {layer}"
    )


async def run(args: argparse.Namespace, console: Console) -> dict:
    from transformers import AutoTokenizer

    from agentrl.model_store import resolve_model_path

    args.model = resolve_model_path(args.model)
    result: dict = {"args": vars(args)}
    if not args.skip_engine:
        result["engine"] = await bench_engine(args, console)
    with console.status("orchestration overhead"):
        result["overhead"] = await bench_overhead(args, AutoTokenizer.from_pretrained(args.model))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--num-prompts-b1", type=int, default=3, help="prompts run one at a time")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument(
        "--episodes", type=int, default=256, help="concurrent episodes for the overhead run"
    )
    parser.add_argument(
        "--skip-engine", action="store_true", help="only the orchestration overhead"
    )
    parser.add_argument("--out", default="benchmarks/bench_rollout.json")
    args = parser.parse_args()
    console = Console()
    result = asyncio.run(run(args, console))
    report(result, console)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
