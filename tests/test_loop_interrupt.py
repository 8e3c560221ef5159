"""An interrupt that lands while the weights are being updated lets the update finish and
counts the step, so the checkpoint taken on the way out holds whole steps."""

from __future__ import annotations

import asyncio
import json
import threading

from agentrl.config import LogConfig, recipe_for_env
from agentrl.data import TaskSource
from agentrl.rollout.collect import Collected
from agentrl.run.metrics import MetricsLogger
from agentrl.run.schedules import Rollout
from agentrl.run.state import RunState
from agentrl.types import Task
from tests.eval.conftest import build_traj


class _SlowTrainer:
    """Stands in for the runtime: a train step on a worker thread that takes a while."""

    pad_id, dp_size = 0, 1

    def __init__(self) -> None:
        self.started, self.finished = threading.Event(), threading.Event()

    async def train_step(self, batches):
        def work():
            self.started.set()
            threading.Event().wait(0.5)
            self.finished.set()
            return {"loss": 0.0}

        return await asyncio.to_thread(work)


async def test_interrupt_mid_update_finishes_the_step_and_counts_it(tmp_path):
    cfg = recipe_for_env("calculator")
    trainer = _SlowTrainer()
    logger = MetricsLogger(tmp_path, LogConfig(use_tensorboard=False))
    source = TaskSource([Task(id="t0", data={})], seed=0)
    state = RunState(cfg, tmp_path, trainer, None, source, [], logger, [])  # type: ignore[arg-type]
    groups = [[build_traj(float(i % 2), task_id="t0") for i in range(4)]]
    rollout = Rollout(Collected(groups=groups), {"cursor": 1}, 0.1)
    assert state.data_state != {"cursor": 1}
    (tmp_path / "rollouts").mkdir()

    learning = asyncio.ensure_future(state.learn(0, rollout))
    while not trainer.started.is_set():
        await asyncio.sleep(0.01)
    learning.cancel()  # what Ctrl-C / SIGTERM do to the run
    try:
        await learning
    except asyncio.CancelledError:
        pass
    else:
        raise AssertionError("the interrupt must still stop the run")
    assert trainer.finished.is_set()  # the update was not abandoned half-way
    assert state.step == 1 and state.data_state == {"cursor": 1}  # and the step counts
    # The step is saved on the way out, so its metrics line is written before the interrupt
    # goes on (flushed: read back while the logger is still open).
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1]
    assert lines[0]["train/loss"] == 0.0 and lines[0]["rollout/num_episodes"] == 4.0
    logger.close()
