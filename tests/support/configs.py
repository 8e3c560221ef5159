"""A two-step calculator run on the tiny random model, as the loop, Ray and router train tests use it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentrl.config import RunConfig, recipe_for_env


def tiny_train_config(
    model_path: str, save: Path, *, entropy_coef: float = 1e-3, **cluster: Any
) -> RunConfig:
    cfg = recipe_for_env("calculator")
    cfg.model.path = model_path
    cfg.checkpoint.save = str(save)
    cfg.checkpoint.save_interval = 1
    cfg.train.num_rollout = 2
    cfg.train.lr = 1e-3
    # The random model earns no reward, so its groups carry no advantage; an entropy term still
    # moves the weights, so the trainer runs (a batch without signal is skipped) and syncs news.
    cfg.algo.entropy_coef = entropy_coef
    cfg.rollout.rollout_batch_size = 2
    cfg.rollout.n_samples_per_prompt = 2
    cfg.rollout.rollout_max_response_len = 12
    cfg.rollout.max_turns = 2
    cfg.eval.num_eval_tasks = 2
    cfg.eval.eval_at_start = False
    cfg.log.progress = False
    cfg.log.use_tensorboard = False
    for key, value in cluster.items():
        setattr(cfg.cluster, key, value)
    return cfg
