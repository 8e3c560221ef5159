"""Fields of a run config that must agree with each other and with this machine: checked once the
config is whole (after flags, `--set` and a resumed run's saved config), before anything loads."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util

from agentrl.config import ConfigError, RunConfig, TrainConfig
from agentrl.config_correction import settings_from_config
from agentrl.deploy.plan import plan_deployment


def resolved(cfg: RunConfig) -> RunConfig:
    """A copy of `cfg` with the defaults that follow from other fields filled in (`cfg` stays
    as given): TIS on with `--async`, whose turns come from older policies, unless a rollout
    correction is asked for."""
    algo = cfg.algo
    if algo.use_tis is None:
        is_corrected = bool(algo.rollout_correction or algo.rollout_is or algo.rollout_rs)
        algo = dataclasses.replace(algo, use_tis=cfg.train.use_async and not is_corrected)
    return dataclasses.replace(copy.deepcopy(cfg), algo=algo)


def check_run(cfg: RunConfig) -> None:
    """What no single field's type or bound catches: fields that contradict each other, and
    what this machine lacks for them. A `ConfigError` naming the flags, before anything loads."""
    engine = cfg.engine
    train = cfg.train
    algo = cfg.algo
    rollout = cfg.rollout
    _check_async(cfg)
    _check_ignored_url(cfg)
    _check_group_size(cfg)
    _check_global_batch(cfg)
    _check_rollout_correction(cfg)
    _check_lora(cfg)
    if engine.kind == "http" and not engine.url:
        raise ConfigError(
            "engine.kind=http needs engine.url, e.g. --set engine.url=http://127.0.0.1:30000 "
            "(start one with `agentrl serve --model PATH` or a real SGLang server)"
        )
    if engine.url and not engine.url.startswith(("http://", "https://")):
        raise ConfigError(
            f"engine.url={engine.url!r} must start with http:// or https://, "
            "e.g. http://127.0.0.1:30000"
        )
    if train.backend == "torch":
        megatron_only = {
            "--tensor-model-parallel-size": train.tensor_model_parallel_size != 1,
            "--pipeline-model-parallel-size": train.pipeline_model_parallel_size != 1,
            "--sequence-parallel": train.sequence_parallel,
            "--recompute-granularity": train.recompute_granularity is not None,
            "--use-distributed-optimizer": train.use_distributed_optimizer,
        }
        if given := [flag for flag, is_set in megatron_only.items() if is_set]:
            verb = "needs" if len(given) == 1 else "need"
            raise ConfigError(
                f"{', '.join(given)} {verb} --train-backend megatron (train.backend is torch, "
                "which would ignore it); add --train-backend megatron or drop it"
            )
    if algo.eps_clip_high is not None and algo.eps_clip_high < algo.eps_clip:
        raise ConfigError(
            f"--eps-clip-high={algo.eps_clip_high} is below --eps-clip={algo.eps_clip}: the upper "
            "clip is 1 + eps_clip_high; raise it (clip-higher) or leave it unset"
        )
    if train.min_lr > train.lr:
        raise ConfigError(
            f"train.min_lr={train.min_lr} is above --lr={train.lr}; lower train.min_lr"
        )
    if rollout.rollout_max_response_len > rollout.rollout_max_context_len:
        raise ConfigError(
            f"--rollout-max-response-len={rollout.rollout_max_response_len} is more than "
            f"rollout.rollout_max_context_len={rollout.rollout_max_context_len} (the whole "
            "episode); lower the first or raise the second"
        )
    if cfg.cluster.ray_address and not _is_ray_address(cfg.cluster.ray_address):
        raise ConfigError(
            f"--ray-address={cfg.cluster.ray_address!r} is not a Ray address; use HOST:PORT of the "
            "head node (e.g. 10.0.0.1:6379), ray://HOST:PORT, or auto"
        )
    for extra in ("wandb", "tensorboard"):
        if getattr(cfg.log, f"use_{extra}") and importlib.util.find_spec(extra) is None:
            raise ConfigError(
                f"log.use_{extra}=true but {extra} is not installed; pip install {extra}, or "
                f"--set log.use_{extra}=false"
            )
    plan_deployment(cfg)  # late: it asks torch whether model.device=auto is a GPU
    if cfg.model.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"model.device={cfg.model.device!r} but torch sees no CUDA GPU here; use "
                "model.device=auto or cpu"
            )


def _check_async(cfg: RunConfig) -> None:
    """Refuse async settings that cannot work, naming the flag and the fix (the placement
    `--async` needs: `deploy.plan`)."""
    train = cfg.train
    if not train.use_async:
        if train.async_mode == "full":
            raise ConfigError("train.async_mode='full' needs train.use_async=true (--async)")
        return
    lag = train.update_weights_interval
    if (
        train.async_mode == "one_step"
        and train.max_staleness is not None
        and lag > train.max_staleness
    ):
        raise ConfigError(
            f"--update-weights-interval={lag} makes --async rollouts up to {lag} policy versions "
            f"old, past --max-staleness={train.max_staleness}: raise --max-staleness to {lag}"
        )


def _check_rollout_correction(cfg: RunConfig) -> None:
    """Rejection bounds that keep nothing, and bounds no level would read."""
    algo = cfg.algo
    s = settings_from_config(algo)
    has_bound = s.rollout_rs_threshold is not None or s.rollout_rs_threshold_lower is not None
    if s.rollout_rs is None and has_bound:
        field = (
            "rollout_rs_threshold" if algo.rollout_rs_threshold else "rollout_rs_threshold_lower"
        )
        raise ConfigError(
            f"algo.{field} is set but algo.rollout_rs is off, which would ignore it; add "
            "--set algo.rollout_rs=token (or sequence, geometric), or drop it"
        )
    if s.rollout_rs is not None:
        upper = s.rollout_rs_threshold or 2.0
        lower = s.rollout_rs_threshold_lower or 1.0 / upper
        if lower >= upper:
            raise ConfigError(
                f"algo.rollout_rs_threshold_lower={lower} is not below algo.rollout_rs_threshold="
                f"{upper}: no ratio would be kept; lower the first or raise the second"
            )


def _check_ignored_url(cfg: RunConfig) -> None:
    """A URL only kind=http uses: set with another kind, it would be ignored without a word."""
    engine = cfg.engine
    if engine.url and engine.kind != "http":
        raise ConfigError(
            f"engine.url={engine.url!r} is set but engine.kind={engine.kind} ignores it; add "
            "--set engine.kind=http to use that server, or drop engine.url"
        )


GROUP_RELATIVE_ESTIMATORS = ("grpo", "rloo")
"""Advantages measured against the other episodes of a task's group: with one episode per task
there is no other, and the advantage falls back to the raw reward (no baseline at all).
reinforce_plus_plus whitens over the whole batch instead (valid with one episode per task);
reinforce_plus_plus_baseline then subtracts nothing and whitens the same way."""


def _check_group_size(cfg: RunConfig) -> None:
    estimator = cfg.algo.advantage_estimator
    n = cfg.rollout.n_samples_per_prompt
    if n == 1 and estimator in GROUP_RELATIVE_ESTIMATORS:
        raise ConfigError(
            f"--n-samples-per-prompt 1 leaves --advantage-estimator {estimator} no group to "
            "compare an episode with (its advantage would be the raw reward, no baseline); use "
            "--n-samples-per-prompt 2 or more (4-8 is usual), or --advantage-estimator "
            "reinforce_plus_plus"
        )


def _check_global_batch(cfg: RunConfig) -> None:
    """slime's rule: a train step's trajectories split into whole optimizer steps."""
    size = cfg.train.global_batch_size
    rollout = cfg.rollout
    num = rollout.rollout_batch_size * rollout.n_samples_per_prompt
    if size is None or num % size == 0:
        return
    below = max(d for d in range(1, size) if num % d == 0)
    above = min(d for d in range(size + 1, num + 1) if num % d == 0) if size < num else None
    nearest = " or ".join(str(d) for d in (below, above) if d is not None)
    raise ConfigError(
        f"--global-batch-size={size} does not divide --rollout-batch-size x "
        f"--n-samples-per-prompt = {rollout.rollout_batch_size} x {rollout.n_samples_per_prompt} "
        f"= {num} trajectories; use a divisor of {num} (e.g. {nearest})"
    )


LORA_NOT_TRAINED = ("lm_head", "embed_tokens")
"""Layers `--lora-target-modules` may not name: merged LoRA on a head tied to the embedding would
untie them, and only linear layers are adapted."""


def _check_lora(cfg: RunConfig) -> None:
    """`--lora-*` settings: the others need `--lora-rank`; the rank needs peft (and on Megatron
    no pipeline or sequence parallelism); the target modules are all-linear alone or names of
    linear layers."""
    train = cfg.train
    default = TrainConfig()
    if not train.lora_rank:
        given = [
            f"--lora-{name.removeprefix('lora_').replace('_', '-')}"
            for name in ("lora_alpha", "lora_dropout", "lora_target_modules")
            if getattr(train, name) != getattr(default, name)
        ]
        if given:
            raise ConfigError(
                f"{', '.join(given)} without --lora-rank trains no adapter (train.lora_rank=0 is "
                "full fine-tuning); add --lora-rank 16 (or another rank) or drop it"
            )
        return
    if train.backend == "megatron" and (
        train.pipeline_model_parallel_size > 1 or train.sequence_parallel
    ):
        raise ConfigError(
            f"--lora-rank={train.lora_rank} on --train-backend megatron does not support "
            "--pipeline-model-parallel-size > 1 or --sequence-parallel yet; drop them, or use "
            "--train-backend torch"
        )
    names = train.lora_target_modules
    if not names or ("all-linear" in names and len(names) > 1):
        raise ConfigError(
            f"--lora-target-modules={','.join(names)!r} must be all-linear alone or a list of "
            "layer names such as q_proj,k_proj,v_proj,o_proj"
        )
    is_name = [n == "all-linear" or n.replace("_", "a").isalnum() for n in names]
    if bad := [n for n, ok in zip(names, is_name, strict=True) if n in LORA_NOT_TRAINED or not ok]:
        raise ConfigError(
            f"--lora-target-modules names {bad[0]!r}, which cannot take an adapter here (only the "
            "decoder's linear layers, by short name such as q_proj); use all-linear or such names"
        )
    if importlib.util.find_spec("peft") is None:
        raise ConfigError(
            f"--lora-rank={train.lora_rank} needs peft, which is not installed: "
            "pip install 'agentrl[lora]', or drop --lora-rank"
        )


def _is_ray_address(address: str) -> bool:
    if address in ("auto", "local") or address.startswith("ray://"):
        return True
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit()
