"""`agentrl eval`: k episodes per held-out task, pass@k / maj@k with 95% CIs, and
report.json / report.md / report.png; a rerun into the same --out resumes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from agentrl.config import RunConfig
    from agentrl.eval import EvalReport


def register(app: typer.Typer) -> None:
    from agentrl.cli import UserCommand  # a usage error in one line

    app.command("eval", cls=UserCommand)(eval_command)


def eval_command(
    env: Annotated[str, typer.Option(help="A registered env id (`agentrl env list`).")],
    split: Annotated[str, typer.Option(help="The env's task split to evaluate on.")] = "test",
    data: Annotated[
        Path | None,
        typer.Option(help="A JSONL or parquet file of tasks (sets env.eval_data)."),
    ] = None,
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            help="A checkpoint directory (its model/ subdirectory is used when present).",
        ),
    ] = None,
    k: Annotated[
        int | None, typer.Option("-k", "--k", help="Episodes per task (default eval.n_samples).")
    ] = None,
    num_tasks: Annotated[
        int | None,
        typer.Option(
            "--num-tasks",
            help="Evaluate the first N tasks (default: every row of --data, else "
            "eval.num_eval_tasks).",
        ),
    ] = None,
    temperature: Annotated[
        float | None,
        typer.Option(
            "--temperature", help="Sampling temperature; 0 = greedy (default eval.temperature)."
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", help="Output directory (default CHECKPOINT/eval or checkpoint.save/eval)."
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(help="A transformers checkpoint dir or bundled model name."),
    ] = None,
    overrides: Annotated[
        list[str] | None,
        typer.Option("--set", help="section.field=value, applied after the flags; repeatable."),
    ] = None,
    resume: Annotated[bool, typer.Option(help="Reuse episodes already in --out.")] = True,
    seed: Annotated[int | None, typer.Option(help="Sampling seed (default rollout.seed).")] = None,
    agent: Annotated[
        str | None,
        typer.Option(
            help="An agent to evaluate instead of the env's own loop: module:function, an "
            "`async def run(task, client)` that talks to the policy through an OpenAI client.",
        ),
    ] = None,
) -> None:
    """Evaluate a model on held-out tasks: mean reward, pass@k, maj@k, status mix, tools."""
    from agentrl.cli import OutputConsole, fail, quiet_libraries, user_errors

    quiet_libraries()

    console = OutputConsole()
    with user_errors(ValueError, FileNotFoundError):
        cfg = build_config(
            env,
            data=data,
            checkpoint=checkpoint,
            model=model,
            k=k,
            num_tasks=num_tasks,
            temperature=temperature,
            overrides=([f"rollout.agent={agent}"] if agent else []) + (overrides or []),
        )
    from agentrl.cli.merged_model import is_lora_adapter, merged_for_eval
    from agentrl.cli.train_checks import check_agent

    with user_errors():
        check_agent(cfg)  # before the model loads: a bad --agent is one line, not a traceback
    if checkpoint is not None:  # a run dir evaluates its newest checkpoint: say which
        console.print(evaluated_line(Path(cfg.model.path)), soft_wrap=True, markup=False)
    evaluated = cfg.model.path  # the report's model: the checkpoint, not a temporary merge
    if is_lora_adapter(Path(cfg.model.path)):  # a LoRA checkpoint: engines load whole models
        with user_errors(ValueError, FileNotFoundError):
            cfg.model.path = merged_for_eval(Path(cfg.model.path))
    if cfg.eval.temperature == 0 and cfg.eval.n_samples > 1:
        console.print(
            f"[yellow]note:[/] temperature 0 is greedy, so the k={cfg.eval.n_samples} episodes of a "
            "task are alike; pass --temperature 1.0 for a meaningful pass@k"
        )
    out_dir = out or ((checkpoint / "eval") if checkpoint else Path(cfg.checkpoint.save) / "eval")
    seed = cfg.rollout.seed if seed is None else seed
    meta = {
        "env": cfg.env.id,
        "split": cfg.env.eval_data or split,
        "model": evaluated,
        "seed": seed,
    }
    from agentrl.eval.runner import ResumeMismatchError

    if out_dir.exists() and not out_dir.is_dir():
        fail(f"--out {out_dir} is a file; pass a directory")
    with user_errors(ResumeMismatchError):
        report = asyncio.run(_run(cfg, split, out_dir, meta, resume=resume, seed=seed))
    if why := all_aborted(report, cfg):  # a table of n/a would say nothing more
        fail(why, code=1)
    print_report(console, report, out_dir)
    if why := nothing_scored(report, out_dir):  # every episode ERROR: the run failed, say so
        fail(why, code=1)


def nothing_scored(report: EvalReport, out_dir: Path) -> str | None:
    """One line when no episode was scored (every one ERROR or ABORTED), else None."""
    num = report.num_episodes
    failed = report.status_counts.get("error", 0) + report.status_counts.get("aborted", 0)
    if not num or failed < num:
        return None
    reasons = ", ".join(f"{r}: {n}" for r, n in sorted(report.status_reason_counts.items()))
    return (
        f"all {num} episodes failed ({reasons}), so none was scored; the first lines of each "
        f"error are in {out_dir}/eval_trajectories.jsonl (info.error); fix the env or agent and "
        "rerun"
    )


def all_aborted(report: EvalReport, cfg: RunConfig) -> str | None:
    """One line when every episode was ABORTED (so nothing was scored), else None."""
    num = report.num_episodes
    if not num or report.status_counts.get("aborted", 0) < num:
        return None
    reasons = ", ".join(f"{r}: {n}" for r, n in sorted(report.status_reason_counts.items()))
    is_http = cfg.engine.kind == "http"
    engine = f"the engine at {cfg.engine.url}" if is_http else f"the {cfg.engine.kind} engine"
    return (
        f"all {num} episodes were ABORTED ({reasons}): {engine} stopped answering or aborted "
        "them, so none was scored; fix the engine and rerun (aborted tasks are run again)"
    )


def build_config(
    env: str,
    *,
    data: Path | None = None,
    checkpoint: Path | None = None,
    model: str | None = None,
    k: int | None = None,
    num_tasks: int | None = None,
    temperature: float | None = None,
    overrides: list[str] | None = None,
) -> RunConfig:
    """The env's recipe, then the flags, then `--set` overrides."""
    from agentrl.config import config_from_flags
    from agentrl.config_checks import check_run

    if checkpoint is not None and model is not None:
        raise ValueError(
            "--checkpoint and --model both name the model to evaluate; pass one of them"
        )
    if data is not None and not data.exists():
        raise FileNotFoundError(
            f"--data {data} does not exist; pass a JSONL or parquet file of tasks"
        )
    values = {
        "model.path": str(checkpoint_model_dir(checkpoint)) if checkpoint else model,
        "env.eval_data": str(data) if data else None,
        "eval.n_samples": k,
        "eval.num_eval_tasks": num_tasks,
        "eval.temperature": temperature,
    }
    cfg = config_from_flags(env, values, overrides or [])  # -k 0 is out of eval.n_samples' range
    if data is not None and num_tasks is None and not _sets(overrides, "eval.num_eval_tasks"):
        cfg.eval.num_eval_tasks = None  # the user's file is evaluated whole, not the recipe's 64
    check_run(cfg)
    return cfg


def _sets(overrides: list[str] | None, key: str) -> bool:
    return any(item.split("=", 1)[0].strip() == key for item in overrides or [])


def evaluated_line(model_dir: Path) -> str:
    """What `--checkpoint` resolved to: the step of a run's checkpoint, or the model dir."""
    import re

    for part in (model_dir.name, model_dir.parent.name):  # step_N/ or step_N/model/
        if found := re.fullmatch(r"step_(\d+)", part):
            return f"evaluating step {int(found.group(1))} ({model_dir})"
    return f"evaluating the model in {model_dir}"


def checkpoint_model_dir(checkpoint: Path) -> Path:
    """A run dir, its checkpoints/ dir (newest complete checkpoint), a step_* checkpoint, or a
    bare transformers model dir; a checkpoint keeps its model in model/ when it has one."""
    from agentrl.trainer.checkpoint import find_latest

    if not checkpoint.is_dir():
        raise FileNotFoundError(
            f"--checkpoint {checkpoint} is not a directory; pass a run, checkpoint or model directory"
        )
    if not (checkpoint / "config.json").is_file():
        found = find_latest(checkpoint / "checkpoints") or find_latest(checkpoint)
        checkpoint = found or checkpoint
    return checkpoint / "model" if (checkpoint / "model").is_dir() else checkpoint


async def _run(
    cfg: RunConfig,
    split: str,
    out_dir: Path,
    meta: dict[str, Any],
    *,
    resume: bool,
    seed: int,
) -> EvalReport:
    from agentrl.data import load_tasks
    from agentrl.deploy.launch import open_engines
    from agentrl.engine.factory import probe_engine
    from agentrl.envs import spec
    from agentrl.eval import evaluate
    from agentrl.rollout import build_runner

    await probe_engine(cfg.engine)  # a dead engine.url: one line, before --out is written
    env_spec = spec(cfg.env.id)
    env_spec.check_kwargs(cfg.env.kwargs)
    tasks = load_tasks(cfg.env, split, env_spec.load_class())
    if cfg.eval.num_eval_tasks is not None:
        tasks = tasks[: cfg.eval.num_eval_tasks]
    if not tasks:
        raise typer.BadParameter(
            f"no tasks for env {cfg.env.id!r} split {split!r} (data: {cfg.env.eval_data})"
        )
    engines = await open_engines(cfg)
    engine = engines.engine.inner  # no weight update here: the gate stays open
    try:
        runner = build_runner(cfg, engine)
        return await evaluate(
            runner,
            tasks,
            k=cfg.eval.n_samples,
            temperature=cfg.eval.temperature,
            out_dir=out_dir,
            resume=resume,
            progress=cfg.log.progress,
            seed=seed,
            meta=meta,
        )
    finally:
        await engines.close()


def print_report(console: Any, report: EvalReport, out_dir: Path) -> None:
    from rich.table import Table

    from agentrl.eval.report import format_value as fmt

    table = Table(title=f"{report.meta.get('env', '')} · {report.num_tasks} tasks × k={report.k}")
    for column in ("metric", "value", "95% CI", "n"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for name, iv in report.rows():
        table.add_row(name, fmt(iv.mean), f"[{fmt(iv.low)}, {fmt(iv.high)}]", str(iv.n))
    console.print(table)
    mix = ", ".join(f"{s} {frac:.1%}" for s, frac in report.status_mix.items() if frac > 0)
    console.print(
        f"status: {mix or 'no episodes'} · turns {fmt(report.turns_mean)} · tool calls "
        f"{fmt(report.tool_calls_per_episode)} · tool errors {fmt(report.tool_errors_per_episode)} per episode"
    )
    console.print(f"wrote {out_dir}/report.json, report.md, report.png and eval_trajectories.jsonl")
