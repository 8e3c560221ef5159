"""The `code_sandbox` recipe, found by `agentrl.config.recipe_for_env` through the
`agentrl.recipes` entry-point group."""

from __future__ import annotations

from agentrl.config import RunConfig


def recipe() -> RunConfig:
    cfg = RunConfig()
    cfg.env.id = "code_sandbox"
    cfg.rollout.rollout_batch_size = 2
    cfg.rollout.n_samples_per_prompt = 4
    cfg.rollout.rollout_max_response_len = 256
    cfg.rollout.rollout_max_context_len = 2048
    cfg.rollout.max_turns = 3
    cfg.train.num_rollout = 5
    cfg.checkpoint.save = "runs/code_sandbox"
    cfg.eval.num_eval_tasks = 16
    return cfg
