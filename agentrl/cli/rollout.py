"""`agentrl rollout`: run episodes of an env on the configured engine and write one trajectory
per line (JSONL), flushed as each group ends."""

from __future__ import annotations

import asyncio
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from agentrl.config import RunConfig


def rollout_command(
    env: str = typer.Option(..., help="Registered env id (agentrl env list)."),
    num_tasks: int = typer.Option(8, help="Tasks to run, the first N of the split."),
    out: str = typer.Option(..., help="Output JSONL file, one trajectory per line."),
    split: str = typer.Option("train", help="Task split (train, test, ...)."),
    n_samples: int = typer.Option(1, help="Episodes per task (a group)."),
    model: str | None = typer.Option(
        None, help="Transformers checkpoint dir (default: bundled SmolLM2-135M)."
    ),
    temperature: float | None = typer.Option(
        None, help="Sampling temperature (default: the recipe's)."
    ),
    set_: list[str] = typer.Option(
        [], "--set", help="Override any config field: --set section.field=value"
    ),
) -> None:
    """Run NUM_TASKS tasks x N_SAMPLES episodes and write their trajectories to OUT."""
    import logging

    from rich.console import Console

    from agentrl.cli import fail, quiet_libraries, user_errors
    from agentrl.config import config_from_flags
    from agentrl.config_checks import check_run

    quiet_libraries()

    console = Console(stderr=True)
    if num_tasks < 1 or n_samples < 1:
        fail(f"--num-tasks={num_tasks} and --n-samples={n_samples} must both be at least 1")
    if temperature is not None and not 0 <= temperature < math.inf:
        fail(f"--temperature={temperature} must be >= 0 (0 = greedy)")
    with user_errors():
        cfg = config_from_flags(env, {"model.path": model or None}, set_)
        check_run(cfg)
    if problem := _unwritable(Path(out)):
        fail(f"--out {out}: {problem}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    with user_errors():
        summary = asyncio.run(_rollout(cfg, split, num_tasks, n_samples, temperature, out, console))
    console.print(summary)


def _unwritable(out: Path) -> str | None:
    """Why `out` cannot take the trajectories (checked before anything loads, without touching
    an existing file); None when it can."""
    if out.is_dir():
        return "is a directory; pass a file path, e.g. rollouts.jsonl"
    if out.exists() and not out.is_file():  # /dev/null, a pipe: the fsync after each group fails
        return "is not a regular file; pass a file path, e.g. rollouts.jsonl"
    parent = out.parent
    if not parent.is_dir():
        return f"its directory {parent} does not exist; create it or pass another path"
    if not os.access(out if out.exists() else parent, os.W_OK):
        return "is not writable here; pass another path"
    return None


async def _rollout(
    cfg: RunConfig,
    split: str,
    num_tasks: int,
    n_samples: int,
    temperature: float | None,
    out: str,
    console: Console,
) -> str:
    from collections import Counter

    from agentrl.data import load_tasks
    from agentrl.deploy.launch import open_engines
    from agentrl.engine.factory import probe_engine
    from agentrl.envs import spec
    from agentrl.progress import single_phase
    from agentrl.rollout import build_runner
    from agentrl.types import Trajectory, write_jsonl

    await probe_engine(cfg.engine)  # a dead engine.url: one line, before --out is written
    env_spec = spec(cfg.env.id)
    env_spec.check_kwargs(cfg.env.kwargs)  # a bad argument fails here, not in every episode
    tasks = load_tasks(cfg.env, split, env_spec.load_class())[:num_tasks]
    with console.status("[bold]Loading the engine…"):
        engines = await open_engines(cfg)
    engine = engines.engine.inner  # no weight update here: the gate stays open
    statuses: Counter[str] = Counter()
    rewards: list[float] = []
    open(out, "w").close()  # a fresh file once env and engine loaded; groups are appended
    try:
        runner = build_runner(cfg, engine)
        total = len(tasks) * n_samples  # the display train and eval have: a line every 15 s piped
        with single_phase(
            "rollout", total, "episodes", console=console, work=runner.sampled_tokens
        ) as phase:

            def on_episode(traj: Trajectory) -> None:
                statuses[f"{traj.status.value}/{traj.status_reason.value}"] += 1
                rewards.append(traj.reward)
                phase.advance()
                phase.detail = f"mean reward {sum(rewards) / len(rewards):.2f}"

            groups = [
                runner.run_group(task, n_samples, temperature=temperature, on_episode=on_episode)
                for task in tasks
            ]
            for finished in asyncio.as_completed(groups):
                write_jsonl(out, await finished, append=True)
    finally:
        await engines.close()
    counts = ", ".join(f"{k} {v}" for k, v in sorted(statuses.items()))
    mean = sum(rewards) / max(len(rewards), 1)
    return f"[green]wrote[/green] {len(rewards)} trajectories to {out}: mean reward {mean:.3f}; {counts}"


def register(app: typer.Typer) -> None:
    from agentrl.cli import UserCommand  # a usage error in one line

    app.command("rollout", cls=UserCommand)(rollout_command)
