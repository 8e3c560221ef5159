"""megatron-core's `OptimizerParamScheduler`, as the Megatron backend configures it, gives the lr of
the torch backend's schedule (`lr_schedule.lr_scheduler`) at every optimizer step: warmup, then
constant, linear or cosine decay to min_lr, held after the last step; also when a run resumes at
step s or a batch without signal advances the schedule by several steps at once."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("agentrl.trainer.megatron.optimizers")  # megatron-core, past a memory saver

from agentrl.config import TrainConfig  # noqa: E402
from agentrl.trainer.megatron.optimizers import lr_schedule  # noqa: E402
from tests.trainer.test_lr_schedule import _lrs as _torch_lrs  # noqa: E402  (torch's schedule)


def _megatron_lrs(cfg: TrainConfig, total_steps: int, num_steps: int) -> list[float]:
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=123.0)
    scheduler = lr_schedule(optimizer, cfg, total_steps)
    out = []
    for _ in range(num_steps):
        out.append(optimizer.param_groups[0]["lr"])
        scheduler.step(1)
    return out


CASES = [
    (style, warmup, total)
    for style in ("constant", "linear", "cosine")
    for warmup in (0, 1, 2, 5)
    for total in (1, 3, 12)
]


@pytest.mark.parametrize(("style", "warmup", "total"), CASES)
def test_every_steps_lr_equals_the_torch_schedule(style: str, warmup: int, total: int) -> None:
    cfg = TrainConfig(lr=2.0, min_lr=0.2, lr_warmup_steps=warmup, lr_decay_style=style)
    num_steps = total + warmup + 4  # past the end of the decay: min_lr holds
    want = _torch_lrs(cfg, total, num_steps)
    assert _megatron_lrs(cfg, total, num_steps) == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_warmup_and_decay_values() -> None:
    """The values themselves, so that both schedules cannot drift together."""
    cfg = TrainConfig(lr=2.0, min_lr=0.2, lr_warmup_steps=2, lr_decay_style="linear")
    lrs = _megatron_lrs(cfg, 12, 16)
    assert lrs[:4] == pytest.approx([1.0, 2.0, 2.0, 2.0 - 1.8 / 10])
    assert lrs[12:] == pytest.approx([0.2] * 4)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_a_schedule_built_at_step_s_continues_there(style: str) -> None:
    """A resumed run (and a skipped batch's several steps at once) lands on the same lr."""
    cfg = TrainConfig(lr=1.0, min_lr=0.1, lr_warmup_steps=3, lr_decay_style=style)
    want = _torch_lrs(cfg, 10, 16)
    for start in (0, 2, 3, 7, 12):
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        scheduler = lr_schedule(optimizer, cfg, 10, step=start)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(want[start])
        scheduler.step(2)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(want[start + 2])


def test_weight_decay_stays_on_every_parameter_group() -> None:
    """As the torch backend's AdamW: megatron-core marks biases and norms wd_mult 0, which its
    scheduler would turn into no weight decay; agentrl's schedule moves the lr alone."""
    cfg = TrainConfig(lr=1.0, weight_decay=0.1)
    optimizer = torch.optim.SGD(
        [{"params": [torch.zeros(2, requires_grad=True)], "wd_mult": 0.0},
         {"params": [torch.zeros(1, requires_grad=True)], "wd_mult": 1.0}],
        lr=1.0, weight_decay=0.1,
    )  # fmt: skip
    lr_schedule(optimizer, cfg, 10).step(1)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.1]
    assert [g["wd_mult"] for g in optimizer.param_groups] == [0.0, 1.0]  # checkpoints match on it
