"""`agentrl train`: build the run config (recipe, slime-named flags, `--set`) and run the loop."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from agentrl.config import RunConfig

# slime's flags set the config field of their own name (`--eps-clip`: algo.eps_clip), but for
# these. Each is a typed option below, so an unknown flag is an error that names it (typer: "No
# such option: --x").
RENAMED_FLAGS = {
    "model": "model.path",
    "async_": "train.use_async",
    "train_backend": "train.backend",
    "max_tokens_per_gpu": "train.max_tokens_per_micro_batch",
}
COMMAND_FLAGS = ("env", "resume", "override", "overwrite", "set_", "show_config")
"""`agentrl train`'s own flags; every other one sets a config field."""
PLACEMENT = "Placement (Ray; any of these runs trainer and engines as Ray actors)"
TRAINER = "Trainer backend (Megatron flags need --train-backend megatron)"


def build_config(
    env: str | None,
    flags: dict[str, object],
    overrides: list[str],
    resume: str | None,
    *,
    is_override: bool = False,
):
    """Recipe for the env (or, with `--resume`, the run's saved config), then slime-named
    flags, then `--set` overrides (last wins). On resume, a flag that changes the saved config
    is refused unless `is_override` (`--override`); the run trains in the directory `--resume`
    names (or `--save`), never in another its run_config.json names. Returns the config, the
    changed fields and notices to show."""
    from agentrl.config import RunConfig, config_from_flags
    from agentrl.run.run_dir import RunDirError, config_diff, resumed_run_dir, saved_config

    saved = saved_config(resume) if resume else None
    notices = []
    values = {"env.id": env, **{config_key(name): value for name, value in flags.items()}}
    if flags.get("async_mode") is not None and flags.get("async_") is None:
        values["train.use_async"] = True  # --async-mode full says --async too
    base = RunConfig.from_dict(saved) if saved is not None else env or "calculator"
    cfg = config_from_flags(base, values, overrides)
    if resume:
        cfg.checkpoint.resume = resume
        if flags.get("save") is None:
            run_dir = resumed_run_dir(resume)
            named = str((saved or {}).get("checkpoint", {}).get("save") or run_dir)
            if Path(named).resolve() != run_dir.resolve():  # a copy, or a moved run
                notices.append(
                    f"{run_dir / 'run_config.json'} names checkpoint.save={named!r}; this run "
                    f"trains in {str(run_dir)!r}, the --resume directory"
                )
            cfg.checkpoint.save = str(run_dir)
    changed = config_diff(saved, cfg.to_dict()) if saved is not None else []
    if changed and not is_override:
        raise RunDirError(
            f"--resume {resume}: these flags change the saved run config: {'; '.join(changed)}; "
            "add --override to apply them, or drop them to continue as saved"
        )
    return cfg, changed, notices


def config_key(flag: str) -> str:
    """The config field a slime-named flag sets: the one field named so, else `RENAMED_FLAGS`'s."""
    from agentrl.config import RunConfig

    sections = typing.get_type_hints(RunConfig).items()
    keys = [f"{name}.{flag}" for name, section in sections if flag in section.__dataclass_fields__]
    return RENAMED_FLAGS.get(flag) or keys[0]


def _flag(help: str | None = None, panel: str | None = None) -> Any:
    """A slime-named flag, None unless given (the recipe's or saved run's value stands)."""
    return typer.Option(None, help=help, rich_help_panel=panel)


def _placement(help: str) -> Any:
    return _flag(help, PLACEMENT)


def _trainer(help: str | None = None) -> Any:
    return _flag(help, TRAINER)


def train_command(
    env: str | None = _flag(
        "Registered env id (agentrl env list), or module:Class importable from the working "
        "directory (default: calculator; with --resume, the run's own)."
    ),
    agent: str | None = _flag(
        "An agent to train instead of the env's own loop: module:function, an `async def "
        "run(task, client)` that talks to the policy through an OpenAI client."
    ),
    model: str | None = _flag("Transformers checkpoint dir (default: bundled SmolLM2-135M)."),
    save: str | None = _flag("Run directory for checkpoints, metrics and evals."),
    num_rollout: int | None = _flag("Train steps."),
    rollout_batch_size: int | None = _flag("Tasks per train step."),
    n_samples_per_prompt: int | None = _flag("Episodes per task (group size)."),
    global_batch_size: int | None = _flag("Trajectories per optimizer step."),
    advantage_estimator: str | None = _flag(
        "grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline"
    ),
    use_kl_loss: bool | None = _flag("Add KL to the reference policy."),
    kl_loss_coef: float | None = _flag(),
    eps_clip: float | None = _flag(),
    eps_clip_high: float | None = _flag(),
    rollout_temperature: float | None = _flag(),
    rollout_max_response_len: int | None = _flag("Most new tokens per turn."),
    save_interval: int | None = _flag("Save a checkpoint every N steps."),
    save_interval_minutes: float | None = _flag(
        "Also save when N minutes have passed since the last save (preemptible jobs)."
    ),
    eval_interval: int | None = _flag(),
    prompt_data: str | None = _flag(
        "JSONL/parquet training tasks (default: the env's train split)."
    ),
    input_key: str | None = _flag(),
    label_key: str | None = _flag(),
    lr: float | None = _flag(),
    ray_address: str | None = _placement(
        "Join this Ray cluster (default: RAY_ADDRESS, else start a local Ray)."
    ),
    actor_num_nodes: int | None = _placement("Nodes for the trainer ranks."),
    actor_num_gpus_per_node: int | None = _placement(
        "Trainer ranks per node, one GPU each (FSDP2 data parallel)."
    ),
    rollout_num_gpus: int | None = _placement(
        "GPUs for all engine servers (default: the trainer's when colocated, else 1)."
    ),
    rollout_num_gpus_per_engine: int | None = _placement(
        "GPUs of one engine server (its TP size)."
    ),
    colocate: bool | None = _placement(
        "Engines share the trainer's GPUs, releasing memory while it steps."
    ),
    offload_train: bool | None = _placement(
        "Colocated on CUDA: keep the trainer's optimizer state in host memory between steps, "
        "so the engine's KV cache gets its room."
    ),
    update_weight_transport: str | None = _placement(
        "auto | tensor (CUDA IPC, same host) | distributed (NCCL broadcast) | disk"
    ),
    update_weight_buffer_size: int | None = _placement(
        "Bytes per weight bucket sent to the engines (default 2 GiB; slime's 512 MiB)."
    ),
    async_: bool | None = typer.Option(
        None,
        "--async/--no-async",
        help="Generate the next step while this one trains (disaggregated only; one step "
        "off-policy, as slime's train_async.py).",
        rich_help_panel=PLACEMENT,
    ),
    update_weights_interval: int | None = _placement("With --async: push weights every N steps."),
    async_mode: str | None = _placement(
        "one_step (slime's train_async.py) | full (a rollout worker keeps episodes in "
        "flight across steps; the trainer takes groups as they finish). Implies --async."
    ),
    max_staleness: str | None = _placement(
        "Drop trajectories whose oldest turn is more than K policy versions behind the "
        "trainer (default 2; none = no bound)."
    ),
    num_episodes_in_flight: int | None = _placement(
        "--async-mode full: episodes kept running (default: one rollout batch)."
    ),
    train_backend: str | None = _trainer("torch (FSDP2) | megatron (the megatron extra, CUDA)."),
    tensor_model_parallel_size: int | None = _trainer(),
    pipeline_model_parallel_size: int | None = _trainer(),
    sequence_parallel: bool | None = _trainer(),
    recompute_granularity: str | None = _trainer("full | selective activation recompute."),
    max_tokens_per_gpu: int | None = _trainer("Token budget of one packed micro-batch per GPU."),
    micro_batch_size: int | None = _trainer(
        "Sequences per micro-batch at most (default: as many as fit)."
    ),
    use_distributed_optimizer: bool | None = _trainer(),
    resume: str | None = _flag("Continue the run saved in this directory, with its saved config."),
    override: bool = typer.Option(
        False, help="With --resume: apply flags that change the saved config (shown as a diff)."
    ),
    overwrite: bool = typer.Option(
        False, help="Start over in a --save directory that holds an earlier run (deletes it)."
    ),
    set_: list[str] = typer.Option(
        [], "--set", help="Override any config field: --set section.field=value"
    ),
    show_config: bool = typer.Option(False, help="Print the resolved config and exit."),
) -> None:
    """Train a policy on an env with GRPO-family RL; runs on CPU with the embedded defaults."""
    flags = {k: v for k, v in locals().items() if k not in COMMAND_FLAGS}  # before other locals
    import errno
    import json
    import logging

    from rich.console import Console
    from rich.markup import escape

    from agentrl.cli import fail, quiet_libraries, user_errors

    console = Console()
    with user_errors():
        cfg, changed, notices = build_config(env, flags, set_, resume, is_override=override)
        cfg.checkpoint.overwrite = overwrite
    for line in changed:
        console.print(f"[yellow]override[/yellow] {line}", soft_wrap=True)
    for line in notices:
        console.print(f"[yellow]note[/yellow] {escape(line)}", soft_wrap=True)
    if show_config:
        console.print_json(json.dumps(cfg.to_dict()))
        return
    with user_errors():
        check_before_writing(cfg)
    quiet_libraries()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("agentrl").setLevel(logging.INFO)  # ours only: no library INFO chatter
    for handler in logging.getLogger().handlers:  # libraries that set their own level (bm25s
        handler.addFilter(_ours_or_warning)  # logs an INFO line per empty query) too
    from agentrl.engine.base import EngineMemoryError
    from agentrl.progress import RunProgress
    from agentrl.run import train
    from agentrl.trainer.checkpoint_space import CheckpointSaveError

    try:
        with user_errors():
            result = train(cfg, RunProgress(enabled=cfg.log.progress, console=console))
    except CheckpointSaveError as e:  # the disk is full: the line says what and how to go on
        fail(str(e), code=1)
    except KeyboardInterrupt:
        console.print(f"[yellow]stopped[/yellow]: {_saved_line(cfg)}", soft_wrap=True)
        raise typer.Exit(130)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # Full while writing rollouts, metrics or evals (a checkpoint says more, above).
        where = f" writing {e.filename}" if e.filename else ""
        fail(f"{e.strerror}{where}; free space: {_saved_line(cfg)}", code=1)
    except EngineMemoryError as e:
        lower = round(cfg.engine.mem_fraction_static * 0.75, 2)
        fix = f" --override --set engine.mem_fraction_static={lower}"
        fail(f"{e}\n{_saved_line(cfg, fix)}", code=1)
    console.print(done_line(result), soft_wrap=True)


def check_before_writing(cfg: RunConfig) -> None:
    """What fails a run before its directory is made, in one line: the agent (it must import
    and be an `async def`) and, on resume, every pickle of the checkpoint."""
    from agentrl.config import ConfigError

    if cfg.rollout.agent:
        from agentrl.agents import load_agent

        try:
            load_agent(cfg.rollout.agent)
        except ValueError as e:
            raise ConfigError(" ".join(str(e).split())) from None
        except Exception as e:  # the agent's module ran and raised: its own error, one line
            raise ConfigError(
                f"rollout.agent={cfg.rollout.agent!r}: importing it raised "
                f"{type(e).__name__}: {' '.join(str(e).split())}; fix the module or pass "
                "another --agent"
            ) from None
    if cfg.checkpoint.resume:
        from agentrl.run.checkpoint import checkpoint_to_resume, read_loop_state
        from agentrl.trainer.checkpoint_safety import check_checkpoint

        ckpt = checkpoint_to_resume(cfg.checkpoint.resume)
        check_checkpoint(ckpt)
        read_loop_state(ckpt)


def _saved_line(cfg: RunConfig, extra: str = "") -> str:
    from agentrl.trainer.checkpoint import find_latest

    run_dir = Path(cfg.checkpoint.save)
    ckpt = find_latest(run_dir / "checkpoints") or run_dir / "checkpoints"
    return (
        f"the last completed step is saved in {ckpt}; continue with: "
        f"agentrl train --resume {run_dir}{extra}"
    )


def done_line(result) -> str:
    """The run's outcome: held-out reward and pass rate at the first and last evaluation, with
    the paired difference over the same tasks and its 95% interval."""
    from agentrl.eval.compare import compare_dirs, format_diff

    first = result.evals[0] if result.evals else {}
    last = result.evals[-1] if result.evals else {}
    line = (
        f"done: {result.num_steps} steps, run dir {Path(result.run_dir)}; held-out reward "
        f"{first.get('reward_mean', float('nan')):.3f} (step {first.get('step', '-')}) -> "
        f"{last.get('reward_mean', float('nan')):.3f} (step {last.get('step', '-')})"
    )
    if len(result.evals) > 1:
        eval_dir = Path(result.run_dir) / "eval"
        try:
            diffs = compare_dirs(
                eval_dir / f"step_{first['step']:06d}", eval_dir / f"step_{last['step']:06d}"
            )
        except FileNotFoundError:
            diffs = {}
        shown = [
            format_diff(name, diffs[name]) for name in ("reward", "pass_rate") if name in diffs
        ]
        if shown:
            line += "; change (paired, 95% CI): " + ", ".join(shown)
    return f"{line}; checkpoint {result.last_checkpoint}"


def _ours_or_warning(record) -> bool:
    return record.levelno >= 30 or record.name.split(".")[0] in ("agentrl", "agentrl_envs")


def register(app: typer.Typer) -> None:
    app.command("train")(train_command)
