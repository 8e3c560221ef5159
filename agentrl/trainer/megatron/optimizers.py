"""megatron-core's optimizer as the Megatron backend builds it (fp32 master weights, Adam in torch's
fused form where neither Apex nor TransformerEngine supplies one), its lr schedule (megatron-core's
`OptimizerParamScheduler`, configured to give the torch backend's lr at every step), and the torch
optimizers inside it, for the code that reaches past it (offloading, checkpoints)."""

from __future__ import annotations

from typing import Any

import agentrl.trainer.megatron.saver_compat  # noqa: F401  (before megatron.core: see there)

# isort: split
import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from agentrl.config import TrainConfig
from agentrl.trainer.lr_schedule import decay_phases


def torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside megatron-core's (one per chained group)."""
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def build_optimizer(cfg: TrainConfig, param_dtype: torch.dtype, model: Any) -> Any:
    """Megatron's optimizer over `model` (sharded over DP with the distributed optimizer)."""
    config = OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        clip_grad=cfg.clip_grad if cfg.clip_grad > 0 else 0.0,
        bf16=param_dtype == torch.bfloat16,
        params_dtype=param_dtype,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(config, [model])
    _fuse_torch_adam(optimizer)
    return optimizer


def lr_schedule(optimizer: Any, cfg: TrainConfig, total_steps: int, step: int = 0) -> Any:
    """megatron-core's scheduler at optimizer step `step`; `.step(n)` after n optimizer steps.

    The torch backend's lr at step s is lr * (s + 1) / warmup during warmup, lr at step warmup
    too, then the decay over the remaining steps. In megatron-core's terms (its `num_steps` = s):
    a warmup from lr / warmup over warmup - 1 steps, and the decay as "WSD" (warmup, stable,
    decay) with one stable step and the whole decay as its annealing phase."""
    warmup, num_decay = decay_phases(cfg, total_steps)
    is_constant = cfg.lr_decay_style == "constant"
    scheduler = _LrSchedule(
        optimizer,
        init_lr=cfg.lr / warmup if warmup else cfg.lr,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        lr_warmup_steps=max(warmup - 1, 0),
        lr_decay_steps=warmup + num_decay,
        lr_decay_style="constant" if is_constant else "WSD",
        wsd_decay_steps=num_decay,
        lr_wsd_decay_style=None if is_constant else cfg.lr_decay_style,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=warmup + num_decay,
        wd_incr_style="constant",
    )
    scheduler.step(step)
    return scheduler


class _LrSchedule(OptimizerParamScheduler):
    """megatron-core's schedule of the lr alone. Its own step also sets each group's weight decay
    times the group's `wd_mult`, which megatron-core sets to 0 for biases and norms; agentrl
    decays every parameter alike, as the torch backend's AdamW does. (`wd_mult` itself cannot
    change: megatron-core identifies a checkpoint's parameter groups by it.)"""

    def step(self, increment: int) -> None:
        self.num_steps += increment
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group)


def _fuse_torch_adam(optimizer: Any) -> None:
    """Without Apex or TransformerEngine, megatron-core steps torch's Adam in its foreach form:
    a dozen passes over the fp32 master weights and moments. The fused form (what their FusedAdam
    is) updates each tensor in one kernel. Set before the first step, so the step counters are
    created where the fused kernel keeps them. A checkpoint restores the form it was saved in
    (torch's load_state_dict takes the saved param groups)."""
    for inner in torch_optimizers(optimizer):
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW) or inner.state:
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        if all(p.is_floating_point() and p.device.type in ("cuda", "cpu") for p in params):
            inner.defaults.update(fused=True, foreach=False)
            for group in inner.param_groups:
                group.update(fused=True, foreach=False)
