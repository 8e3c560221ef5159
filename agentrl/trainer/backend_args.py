"""What both trainer backends check and resolve before they load anything (a module of its own:
the backends import it, and `agentrl.trainer.backend` imports the backends)."""

from __future__ import annotations

from pathlib import Path

import torch

from agentrl.config import ConfigError, TrainConfig


def check_backend_args(
    train_cfg: TrainConfig, *, dtype: str, temperature: float, device: str = "auto"
) -> None:
    """What every backend refuses before it looks at the machine or loads anything (a
    `ConfigError`: the command line prints it as one line)."""
    if dtype not in ("auto", "float32", "bfloat16"):
        raise ConfigError(f"dtype={dtype!r} is not supported; use auto, float32 or bfloat16")
    if temperature <= 0:
        raise ConfigError(f"temperature={temperature} must be > 0 (use 1.0 for greedy rollouts)")
    if train_cfg.lr < 0 or train_cfg.min_lr < 0:
        raise ConfigError(
            f"train.lr={train_cfg.lr} and train.min_lr={train_cfg.min_lr} must be >= 0"
        )
    if device != "auto":
        try:
            torch.device(device)
        except RuntimeError:
            raise ConfigError(
                f"model.device={device!r} is not a torch device; use auto, cpu, cuda or cuda:N"
            ) from None


def local_model_path(model_path: str) -> str:
    """A checkpoint directory as is; a bundled name (smollm2-135m-instruct) through the model store."""
    if Path(model_path).is_dir():
        return model_path
    try:
        from agentrl.model_store import resolve_model_path
    except ImportError:
        return model_path
    return resolve_model_path(model_path)
