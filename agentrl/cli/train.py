"""`agentrl train`: build the run config (recipe, `--config` file, slime-named flags, `--set`) and
run the loop."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from agentrl.cli.train_checks import check_before_writing, finished_line
from agentrl.cli.train_flags import TrainCommand, build_config, resume_from_load

if TYPE_CHECKING:
    from agentrl.config import RunConfig

DATA = "Model and data"
ROLLOUT = "Rollout (training episodes)"
ALGO = "Algorithm and optimizer"
SAVE_EVAL = "Checkpoints, evaluation, logging"
PLACEMENT = "Placement (Ray; any of these runs trainer and engines as Ray actors)"
TRAINER = "Trainer backend (Megatron flags need --train-backend megatron)"


def _flag(help: str, panel: str | None = None, *names: str, metavar: str | None = None) -> Any:
    """A flag, None unless given (the recipe's or saved run's value stands)."""
    return typer.Option(None, *names, help=help, rich_help_panel=panel, metavar=metavar)


def train_command(
    env: str | None = _flag(
        "Registered env id (agentrl env list), or module:Class importable from the working "
        "directory (default: calculator; with --resume, the run's own)."
    ),
    config: str | None = _flag(
        "A YAML or JSON file of section.field values (or sections of fields), applied over the "
        "env's recipe and under the flags and --set; a run's run_config.json is one.",
        metavar="FILE",
    ),
    set_: list[str] = typer.Option(
        [],
        "--set",
        help="Override any config field: --set section.field=value (repeatable).",
        metavar="KEY=VALUE",
    ),
    agent: str | None = _flag(
        "An agent to train instead of the env's own loop: module:function, an `async def "
        "run(task, client)` that talks to the policy through an OpenAI client (default: none)."
    ),
    resume: str | None = _flag(
        "Continue the run saved in this directory, with its saved config.", metavar="DIR"
    ),
    load: str | None = _flag(
        "slime's --load: continue the run in this directory if it holds one, else start a new "
        "run (so --load DIR --save DIR works from the first launch).",
        metavar="DIR",
    ),
    override: bool = typer.Option(
        False,
        "--override",
        help="With --resume: apply flags that change the saved config (shown as a diff).",
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Start over in a --save directory that holds an earlier run (deletes it).",
    ),
    show_config: bool = typer.Option(
        False, "--show-config", help="Print the resolved config and exit."
    ),
    model: str | None = _flag(
        "Transformers checkpoint dir; --hf-checkpoint is slime's name (default: the bundled "
        "SmolLM2-135M).",
        DATA,
        "--model",
        "--hf-checkpoint",
    ),
    ref_load: str | None = _flag(
        "slime's reference checkpoint: not read; the KL reference is the starting model (--model).",
        DATA,
    ),
    prompt_data: str | None = _flag(
        "JSONL/parquet training tasks (default: the env's train split).", DATA
    ),
    eval_prompt_data: str | None = _flag(
        "One JSONL/parquet file of held-out tasks: PATH, or slime's NAME PATH (default: the "
        "env's test split).",
        DATA,
    ),
    input_key: str | None = _flag("Column holding the prompt (default: the env's own).", DATA),
    label_key: str | None = _flag("Column holding the label (default: the env's own).", DATA),
    num_rollout: int | None = _flag("Train steps.", ROLLOUT),
    rollout_batch_size: int | None = _flag("Tasks per train step.", ROLLOUT),
    n_samples_per_prompt: int | None = _flag("Episodes per task, the group size.", ROLLOUT),
    rollout_max_response_len: int | None = _flag(
        "Most new tokens per turn; in slime, per response.", ROLLOUT
    ),
    rollout_max_context_len: int | None = _flag(
        "Most tokens in an episode: prompt, turns and observations.", ROLLOUT
    ),
    rollout_temperature: float | None = _flag("Sampling temperature.", ROLLOUT),
    rollout_top_p: float | None = _flag("Top-p of sampling.", ROLLOUT),
    rollout_top_k: int | None = _flag("Top-k of sampling; -1 = off.", ROLLOUT),
    advantage_estimator: str | None = _flag(
        "grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline; slime's gspo and "
        "cispo set algo.policy_loss.",
        ALGO,
    ),
    global_batch_size: int | None = _flag(
        "Trajectories per optimizer step (default: the whole rollout batch, one step).", ALGO
    ),
    eps_clip: float | None = _flag("PPO clip range.", ALGO),
    eps_clip_high: float | None = _flag(
        "Upper clip range, DAPO's clip-higher (default: --eps-clip).", ALGO
    ),
    eps_clip_c: float | None = _flag(
        "Dual-clip constant (> 1) for negative advantages (default: off).", ALGO
    ),
    use_tis: bool | None = _flag(
        "Token-level IS of rollout vs trainer logprobs, capped at --tis-cap (default: on with "
        "--async unless algo.rollout_correction/rollout_is/rollout_rs is set).",
        ALGO,
    ),
    use_kl_loss: bool | None = _flag("Add KL to the reference policy, the starting model.", ALGO),
    kl_loss_coef: float | None = _flag("Weight of the KL term.", ALGO),
    kl_loss_type: str | None = _flag("k1 | k2 | k3 | low_var_kl; slime uses k1.", ALGO),
    entropy_coef: float | None = _flag("Weight of the entropy bonus.", ALGO),
    lr: float | None = _flag("Learning rate.", ALGO),
    min_lr: float | None = _flag("Learning rate at the end of the decay.", ALGO),
    lr_warmup_iters: int | None = _flag("Steps of learning-rate warm-up.", ALGO),
    lr_decay_style: str | None = _flag("constant | linear | cosine.", ALGO),
    weight_decay: float | None = _flag("AdamW weight decay.", ALGO),
    clip_grad: float | None = _flag("Gradient norm clip.", ALGO),
    save: str | None = _flag("Run directory for checkpoints, metrics and evals.", SAVE_EVAL),
    save_interval: int | None = _flag("Save a checkpoint every N steps.", SAVE_EVAL),
    save_interval_minutes: float | None = _flag(
        "Also save when N minutes have passed since the last save (preemptible jobs; "
        "default: off).",
        SAVE_EVAL,
    ),
    eval_interval: int | None = _flag(
        "Evaluate every N steps (default: only at the start and the end).", SAVE_EVAL
    ),
    n_samples_per_eval_prompt: int | None = _flag(
        "Episodes per held-out task, the k of pass@k.", SAVE_EVAL
    ),
    eval_temperature: float | None = _flag(
        "Sampling temperature of held-out episodes; 0 = greedy.", SAVE_EVAL
    ),
    use_wandb: bool | None = _flag(
        "Log metrics to Weights & Biases too; needs the wandb extra.", SAVE_EVAL
    ),
    wandb_project: str | None = _flag("The W&B project.", SAVE_EVAL),
    ray_address: str | None = _flag(
        "Join this Ray cluster (default: RAY_ADDRESS, else start a local Ray).", PLACEMENT
    ),
    actor_num_nodes: int | None = _flag("Nodes for the trainer ranks.", PLACEMENT),
    actor_num_gpus_per_node: int | None = _flag(
        "Trainer ranks per node, one GPU each, FSDP2 data parallel.", PLACEMENT
    ),
    rollout_num_gpus: int | None = _flag(
        "GPUs for all engine servers (default: the trainer's when colocated, else 1; with "
        "--set engine.kind=sglang, of the servers launched from this process, without Ray).",
        PLACEMENT,
    ),
    rollout_num_gpus_per_engine: int | None = _flag(
        "GPUs of one engine server, its TP size.", PLACEMENT
    ),
    colocate: bool | None = _flag(
        "Engines share the trainer's GPUs, releasing memory while it steps.", PLACEMENT
    ),
    offload_train: bool | None = _flag(
        "Colocated on CUDA: keep the trainer's optimizer state in host memory between steps, "
        "so the engine's KV cache gets its room.",
        PLACEMENT,
    ),
    update_weight_transport: str | None = _flag(
        "auto | tensor (CUDA IPC, same host) | distributed (NCCL broadcast) | disk.", PLACEMENT
    ),
    update_weight_buffer_size: int | None = _flag(
        "Bytes per weight bucket sent to the engines (default: 2 GiB; slime's: 512 MiB).",
        PLACEMENT,
    ),
    async_: bool | None = _flag(
        "Generate the next step while this one trains, one step off-policy as slime's "
        "train_async.py; disaggregated only.",
        PLACEMENT,
        "--async/--no-async",
    ),
    update_weights_interval: int | None = _flag(
        "With --async: push weights every N steps.", PLACEMENT
    ),
    async_mode: str | None = _flag(
        "one_step (slime's train_async.py) | full (a rollout worker keeps episodes in "
        "flight across steps; the trainer takes groups as they finish); implies --async.",
        PLACEMENT,
    ),
    max_staleness: str | None = _flag(
        "Drop trajectories whose oldest turn is more than K policy versions behind the "
        "trainer (default: 2; none = no bound).",
        PLACEMENT,
    ),
    num_episodes_in_flight: int | None = _flag(
        "--async-mode full: episodes kept running (default: one rollout batch).", PLACEMENT
    ),
    train_backend: str | None = _flag(
        "torch (FSDP2) | megatron (Megatron-core: CUDA and the megatron extra).", TRAINER
    ),
    tensor_model_parallel_size: int | None = _flag(
        "GPUs each layer's weights are split over.", TRAINER
    ),
    pipeline_model_parallel_size: int | None = _flag(
        "Pipeline stages the layers are split into.", TRAINER
    ),
    sequence_parallel: bool | None = _flag(
        "Split norms and dropout over the tensor-parallel ranks.", TRAINER
    ),
    recompute_granularity: str | None = _flag(
        "full | selective activation recompute (default: off).", TRAINER
    ),
    max_tokens_per_gpu: int | None = _flag(
        "Token budget of one packed micro-batch per GPU.", TRAINER
    ),
    micro_batch_size: int | None = _flag(
        "Sequences per micro-batch at most (default: as many as fit).", TRAINER
    ),
    use_distributed_optimizer: bool | None = _flag(
        "Shard optimizer state over the data-parallel ranks.", TRAINER
    ),
    lora_rank: int | None = _flag(
        "LoRA adapter rank on the torch backend (the lora extra); 0 = full fine-tuning.", TRAINER
    ),
    lora_alpha: int | None = _flag(
        "LoRA scale numerator: the adapter adds alpha / rank x B @ A.", TRAINER
    ),
    lora_dropout: float | None = _flag("Dropout on the adapters' input while training.", TRAINER),
    lora_target_modules: str | None = _flag(
        "all-linear, or comma-separated layer names (q_proj,v_proj or linear_qkv,...).", TRAINER
    ),
) -> None:
    """Train a policy on an env with GRPO-family RL; runs on CPU with the embedded defaults.

    The defaults below are the calculator recipe's, which an env without a recipe gets too; an
    env with a recipe of its own (search_r1) sets its own values, which `agentrl train --env ID
    --show-config` prints. With --resume, a flag not given keeps the saved run's value."""
    flags: dict[str, object] = {
        "agent": agent,
        "model": model,
        "prompt_data": prompt_data,
        "eval_prompt_data": eval_prompt_data,
        "input_key": input_key,
        "label_key": label_key,
        "num_rollout": num_rollout,
        "rollout_batch_size": rollout_batch_size,
        "n_samples_per_prompt": n_samples_per_prompt,
        "rollout_max_response_len": rollout_max_response_len,
        "rollout_max_context_len": rollout_max_context_len,
        "rollout_temperature": rollout_temperature,
        "rollout_top_p": rollout_top_p,
        "rollout_top_k": rollout_top_k,
        "advantage_estimator": advantage_estimator,
        "global_batch_size": global_batch_size,
        "eps_clip": eps_clip,
        "eps_clip_high": eps_clip_high,
        "eps_clip_c": eps_clip_c,
        "use_tis": use_tis,
        "use_kl_loss": use_kl_loss,
        "kl_loss_coef": kl_loss_coef,
        "kl_loss_type": kl_loss_type,
        "entropy_coef": entropy_coef,
        "lr": lr,
        "min_lr": min_lr,
        "lr_warmup_iters": lr_warmup_iters,
        "lr_decay_style": lr_decay_style,
        "weight_decay": weight_decay,
        "clip_grad": clip_grad,
        "save": save,
        "save_interval": save_interval,
        "save_interval_minutes": save_interval_minutes,
        "eval_interval": eval_interval,
        "n_samples_per_eval_prompt": n_samples_per_eval_prompt,
        "eval_temperature": eval_temperature,
        "use_wandb": use_wandb,
        "wandb_project": wandb_project,
        "ray_address": ray_address,
        "actor_num_nodes": actor_num_nodes,
        "actor_num_gpus_per_node": actor_num_gpus_per_node,
        "rollout_num_gpus": rollout_num_gpus,
        "rollout_num_gpus_per_engine": rollout_num_gpus_per_engine,
        "colocate": colocate,
        "offload_train": offload_train,
        "update_weight_transport": update_weight_transport,
        "update_weight_buffer_size": update_weight_buffer_size,
        "async_": async_,
        "update_weights_interval": update_weights_interval,
        "async_mode": async_mode,
        "max_staleness": max_staleness,
        "num_episodes_in_flight": num_episodes_in_flight,
        "train_backend": train_backend,
        "tensor_model_parallel_size": tensor_model_parallel_size,
        "pipeline_model_parallel_size": pipeline_model_parallel_size,
        "sequence_parallel": sequence_parallel,
        "recompute_granularity": recompute_granularity,
        "max_tokens_per_gpu": max_tokens_per_gpu,
        "micro_batch_size": micro_batch_size,
        "use_distributed_optimizer": use_distributed_optimizer,
        "lora_rank": lora_rank,
        "lora_alpha": lora_alpha,
        "lora_dropout": lora_dropout,
        "lora_target_modules": lora_target_modules,
    }  # every flag that sets a config field (COMMAND_FLAGS are the command's own)
    import errno
    import json
    import logging

    from rich.console import Console
    from rich.markup import escape

    from agentrl.cli import fail, quiet_libraries, user_errors

    console = Console()
    stderr = Console(stderr=True)  # notes, so `--show-config > run.json` is the config alone
    with user_errors():
        resume, notices = resume_from_load(resume, load, ref_load)
        cfg, changed, more = build_config(
            env, flags, set_, resume, is_override=override, config_file=config
        )
        cfg.checkpoint.overwrite = overwrite
    notices += more
    for line in changed:
        stderr.print(f"[yellow]override[/yellow] {line}", soft_wrap=True)
    for line in notices:
        stderr.print(f"[yellow]note[/yellow] {escape(line)}", soft_wrap=True)
    if show_config:
        console.print_json(json.dumps(cfg.to_dict()))
        return
    with user_errors():
        loop_state = check_before_writing(cfg)
    if loop_state is not None and (line := finished_line(cfg, loop_state)):
        console.print(line, soft_wrap=True, markup=False, highlight=False)
        return
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
    app.command("train", cls=TrainCommand)(train_command)
