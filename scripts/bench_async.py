"""Asynchronous training benchmark: train steps per hour of synchronous training, `--async`
(one step off-policy) and `--async-mode full` on the same workload in one run -- the `slow_tools`
env (lognormal tool latency, p99 >= 10x median) and a random-init model -- with the idle
fractions of trainer and engines and the staleness of what was trained. JSON, a PNG and a table.

    python scripts/bench_async.py                       # CPU, embedded engine, ~5 min
    python scripts/bench_async.py --steps 4 --median-latency-s 0.1
    python scripts/bench_async.py --gpus --shape smollm2-135m --out benchmarks/async_gpu
        # 2 GPUs: trainer on one, engine server on the other (Ray, disaggregated)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agentrl.config import RunConfig, recipe_for_env  # noqa: E402
from agentrl.run import train  # noqa: E402

MODES = ("sync", "one_step", "full")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="train steps per mode")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: sync,one_step,full")
    p.add_argument("--rollout-batch-size", type=int, default=4)
    p.add_argument("--n-samples-per-prompt", type=int, default=4)
    p.add_argument("--max-response-len", type=int, default=16)
    p.add_argument("--num-turns", type=int, default=3, help="assistant turns per episode")
    p.add_argument("--median-latency-s", type=float, default=0.3, help="median tool latency")
    p.add_argument(
        "--latency-sigma", type=float, default=1.0, help="lognormal log-std (1.0: p99 = 10x median)"
    )
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument(
        "--model", default=None, help="checkpoint dir (default: a random model of --shape)"
    )
    p.add_argument(
        "--shape",
        default="tiny",
        help="tiny (2 layers, 64 wide) or a SmolLM2 shape, e.g. smollm2-135m",
    )
    p.add_argument("--gpus", action="store_true", help="disaggregated on 2 GPUs through Ray")
    p.add_argument("--out", default="benchmarks/async", help="directory for bench_async.json/.png")
    return p.parse_args()


def make_model(args: argparse.Namespace, root: Path) -> str:
    from agentrl.model_store import resolve_model_path
    from tests.support.random_models import make_shaped_model, save_random_llama

    if args.model:
        return args.model
    tokenizer = resolve_model_path("smollm2-135m-instruct")
    if args.shape == "tiny":
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
        return save_random_llama(str(root / "model"), tokenizer, shape, dtype="float32")
    dtype = "bfloat16" if args.gpus else "float32"
    return make_shaped_model(str(root / "model"), tokenizer, args.shape, dtype=dtype)


def config(args: argparse.Namespace, mode: str, model: str, run_dir: Path) -> RunConfig:
    cfg = recipe_for_env("slow_tools")
    cfg.model.path, cfg.checkpoint.save = model, str(run_dir)
    cfg.env.kwargs = {
        "num_turns": args.num_turns,
        "median_latency_s": args.median_latency_s,
        "latency_sigma": args.latency_sigma,
    }
    cfg.rollout.rollout_batch_size = args.rollout_batch_size
    cfg.rollout.n_samples_per_prompt = args.n_samples_per_prompt
    cfg.rollout.rollout_max_response_len = args.max_response_len
    cfg.rollout.max_turns = args.num_turns
    cfg.train.num_rollout, cfg.train.lr = args.steps, 1e-5
    # A random model's groups mostly tie at reward 0, and tied groups cost the trainer nothing
    # (advantage 0 exactly): without a term that pulls whatever the advantages, the trainer
    # would do no work and the modes would differ only in how rollouts overlap. A small entropy
    # bonus makes every step a full forward + backward + update over all its episodes.
    cfg.algo.entropy_coef = 0.001
    cfg.train.max_staleness = args.max_staleness
    cfg.eval.num_eval_tasks, cfg.eval.eval_at_start = 1, False
    cfg.checkpoint.save_interval = 10**9
    cfg.log.use_tensorboard = False
    if mode != "sync":
        cfg.train.use_async, cfg.train.async_mode = True, mode
    if args.gpus:
        cfg.cluster.actor_num_gpus_per_node, cfg.cluster.rollout_num_gpus = 1, 1
    return cfg


def summarize(run_dir: Path, wall_s: float) -> dict[str, Any]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if "train/loss" in r]
    timed = rows[1:] or rows  # the first step pays for warm-up (codec check, first compile)
    step_s = statistics.mean(r["time/step_s"] for r in timed)

    def mean(key: str) -> float:
        values = [r[key] for r in timed if key in r]
        return statistics.mean(values) if values else float("nan")

    return {
        "steps": len(rows),
        "step_s": step_s,
        "steps_per_hour": 3600.0 / step_s,
        "train_s": mean("time/train_s"),  # the trainer's own work per step
        "trainer_idle_frac": mean("perf/trainer_idle_frac"),
        "engine_idle_frac": mean("perf/engine_idle_frac"),
        "staleness_mean": mean("rollout/staleness_mean"),
        "staleness_max": max(r.get("rollout/staleness_max", 0.0) for r in rows),
        "num_stale_dropped": sum(r.get("rollout/num_stale_dropped", 0.0) for r in rows),
        "episodes_in_flight": mean("rollout/episodes_in_flight"),
        "reward_mean": mean("rollout/reward_mean"),
        "wall_s": wall_s,
    }


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(modes, [results[m]["steps_per_hour"] for m in modes], color="tab:blue")
    left.set_ylabel("train steps / hour")
    left.set_title("throughput")
    x = range(len(modes))
    right.bar([i - 0.2 for i in x], [results[m]["trainer_idle_frac"] for m in modes], 0.4,
              label="trainer")  # fmt: skip
    right.bar([i + 0.2 for i in x], [results[m]["engine_idle_frac"] for m in modes], 0.4,
              label="engines")  # fmt: skip
    right.set_xticks(list(x), modes)
    right.set_ylabel("idle fraction of step time")
    right.set_ylim(0, 1)
    right.legend()
    right.set_title("idle")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(results: dict[str, dict[str, Any]]) -> Table:
    t = Table(title="async training: slow_tools, same workload per mode")
    for col in ("mode", "steps/h", "x sync", "step s", "train s", "trainer idle", "engine idle",
                "staleness mean/max", "stale dropped"):  # fmt: skip
        t.add_column(col, justify="right")
    base = results.get("sync", {}).get("steps_per_hour")
    for mode, r in results.items():
        speedup = f"{r['steps_per_hour'] / base:.2f}" if base else "-"
        t.add_row(
            mode, f"{r['steps_per_hour']:.0f}", speedup, f"{r['step_s']:.2f}", f"{r['train_s']:.2f}",
            f"{r['trainer_idle_frac']:.2f}", f"{r['engine_idle_frac']:.2f}",
            f"{r['staleness_mean']:.2f}/{r['staleness_max']:.0f}", f"{r['num_stale_dropped']:.0f}",
        )  # fmt: skip
    return t


def main() -> None:
    args = parse_args()
    console = Console()
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        raise SystemExit(f"--modes: unknown {sorted(unknown)}; choose from {','.join(MODES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(args, Path(tmp))
        for mode in modes:
            console.rule(f"[bold]{mode}")  # the loop's own rich bar shows the steps
            run_dir = Path(tmp) / mode
            t0 = time.perf_counter()
            train(config(args, mode, model, run_dir))
            results[mode] = summarize(run_dir, time.perf_counter() - t0)
    report = {"args": vars(args), "results": results}
    (out / "bench_async.json").write_text(json.dumps(report, indent=2))
    plot(results, out / "bench_async.png")
    console.print(table(results))
    console.print(f"wrote {out / 'bench_async.json'} and {out / 'bench_async.png'}")


if __name__ == "__main__":
    main()
