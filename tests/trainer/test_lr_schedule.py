"""The lr schedule (torch's schedulers): warmup, then constant, linear or cosine decay to min_lr,
held after the last step, and across a save and load (megatron/test_lr_schedule_megatron.py: the
Megatron backend's schedule gives the same values)."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.config import TrainConfig
from agentrl.trainer.lr_schedule import lr_scheduler


def _lrs(cfg: TrainConfig, total_steps: int, num_steps: int) -> list[float]:
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.lr)
    scheduler = lr_scheduler(optimizer, cfg, total_steps)
    out = []
    for _ in range(num_steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def _cfg(style: str, warmup: int = 2) -> TrainConfig:
    return TrainConfig(lr=2.0, min_lr=0.2, lr_warmup_steps=warmup, lr_decay_style=style)


def test_warmup_then_constant() -> None:
    assert _lrs(_cfg("constant"), 12, 14) == pytest.approx([1.0] + [2.0] * 13)
    assert _lrs(_cfg("constant", warmup=4), 12, 5) == pytest.approx([0.5, 1.0, 1.5, 2.0, 2.0])
    assert _lrs(_cfg("constant", warmup=0), 12, 3) == pytest.approx([2.0] * 3)


def test_linear_decay_reaches_min_lr_and_holds_it() -> None:
    lrs = _lrs(_cfg("linear"), 12, 20)  # 10 decay steps after 2 of warmup
    assert lrs[:4] == pytest.approx([1.0, 2.0, 2.0, 2.0 - 1.8 / 10])
    assert lrs[7] == pytest.approx(0.2 + 1.8 * 0.5)
    assert lrs[12:] == pytest.approx([0.2] * 8)


def test_cosine_decay_reaches_min_lr_and_holds_it() -> None:
    lrs = _lrs(_cfg("cosine"), 12, 30)
    expected = [0.2 + 1.8 * 0.5 * (1 + math.cos(math.pi * (s - 2) / 10)) for s in range(2, 12)]
    assert lrs[2:12] == pytest.approx(expected)
    assert lrs[7] == pytest.approx(1.1)
    assert lrs[12:] == pytest.approx([0.2] * 18)  # a bare cosine would rise again here


def test_resumed_scheduler_continues_where_it_stopped() -> None:
    cfg = _cfg("cosine")
    lrs = _lrs(cfg, 12, 14)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.lr)
    scheduler = lr_scheduler(optimizer, cfg, 12)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    resumed_optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.lr)
    resumed = lr_scheduler(resumed_optimizer, cfg, 12)
    resumed_optimizer.load_state_dict(optimizer.state_dict())  # as a checkpoint load does
    resumed.load_state_dict(scheduler.state_dict())
    assert resumed.get_last_lr()[0] == pytest.approx(lrs[5])
    resumed_optimizer.step()
    resumed.step()
    assert resumed.get_last_lr()[0] == pytest.approx(lrs[6])
