"""The learning-rate schedule: linear warmup over `lr_warmup_steps`, then constant, linear or
cosine decay to `min_lr` at the last optimizer step. The torch backend composes it of torch's
schedulers; the Megatron backend gives the same values with megatron-core's scheduler
(`megatron/optimizers.py`)."""

from __future__ import annotations

import torch
from torch.optim import lr_scheduler as schedulers

from agentrl.config import TrainConfig

_FOREVER = 2**62  # steps a phase lasts when nothing follows it


def decay_phases(cfg: TrainConfig, total_steps: int) -> tuple[int, int]:
    """(warmup steps, decay steps): the shape both backends' schedules share (`config_checks`
    refuses a min_lr above lr)."""
    return cfg.lr_warmup_steps, max(1, total_steps - cfg.lr_warmup_steps)


def lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int
) -> schedulers.LRScheduler:
    """Step it once per optimizer step; the lr at step s is the peak lr times (s + 1) / warmup
    during warmup, then decays over the remaining `total_steps` and holds `min_lr` after them."""
    warmup, num_decay = decay_phases(cfg, total_steps)
    min_ratio = cfg.min_lr / cfg.lr if cfg.lr > 0 else 0.0
    # The factor reaches 1 on the last warmup step and stays there: all of "constant".
    phases: list[schedulers.LRScheduler] = [
        schedulers.LinearLR(optimizer, 1 / max(warmup, 1), 1.0, max(warmup - 1, 1))
    ]
    if cfg.lr_decay_style == "linear":
        phases.append(schedulers.LinearLR(optimizer, 1.0, min_ratio, num_decay))
    elif cfg.lr_decay_style == "cosine":  # past its end a cosine rises again: hold min_lr
        phases.append(schedulers.CosineAnnealingLR(optimizer, num_decay, cfg.min_lr))
        phases.append(schedulers.ConstantLR(optimizer, min_ratio, _FOREVER))
    milestones = [warmup, warmup + num_decay][: len(phases) - 1]  # where each next phase starts
    return schedulers.SequentialLR(optimizer, phases, milestones)
