"""`train(config)`: the top-level loop of DESIGN §1 -- rollout, filter, train, sync, eval, save."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.config import RunConfig
from agentrl.config_checks import check_run, resolved
from agentrl.data import TaskSource, load_tasks
from agentrl.deploy.launch import check_megatron, make_runtime
from agentrl.deploy.plan import plan_deployment
from agentrl.engine.base import EngineMemoryError
from agentrl.engine.factory import probe_engine
from agentrl.envs import spec
from agentrl.progress import RunProgress, step_line
from agentrl.rollout import build_runner
from agentrl.run import run_dir as run_dir_guard
from agentrl.run.checkpoint import resume_run
from agentrl.run.metrics import MetricsLogger
from agentrl.run.schedules import (
    NothingToTrainError,
    Pace,
    SyncSchedule,
    how_to_go_on,
    make_schedule,
    why_untrainable,
)
from agentrl.run.signals import stop_on_signals
from agentrl.run.state import RunState


@dataclass
class TrainResult:
    run_dir: Path
    num_steps: int
    evals: list[dict[str, Any]]
    last_checkpoint: Path | None


def train(cfg: RunConfig, progress: RunProgress | None = None) -> TrainResult:
    """Run `cfg` to the end. Ctrl-C or SIGTERM let a weight update under way finish, save the
    last completed step, stop every worker and raise KeyboardInterrupt. `progress`: the display
    (default: one on stdout, off when `log.progress` is false)."""
    progress = progress or RunProgress(enabled=cfg.log.progress)
    try:
        with progress:
            return asyncio.run(_train(cfg, progress))
    except asyncio.CancelledError:  # SIGTERM cancelled the run
        raise KeyboardInterrupt from None


async def _train(cfg: RunConfig, progress: RunProgress) -> TrainResult:
    # Everything a user can get wrong fails first, in a second, before anything is written:
    # flags, the engine's URL, the env id and its data rows, the model path.
    check_megatron(cfg)
    check_run(cfg)
    await probe_engine(cfg.engine)
    cfg = resolved(cfg)
    env_spec = spec(cfg.env.id)
    env_spec.check_kwargs(cfg.env.kwargs)
    env_cls = env_spec.load_class()
    source = TaskSource(load_tasks(cfg.env, "train", env_cls), seed=cfg.rollout.seed)
    eval_tasks = load_tasks(cfg.env, "test", env_cls)[: cfg.eval.num_eval_tasks]
    from agentrl.model_store import resolve_model_path  # the one resolution of the run

    model_path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    run_dir = Path(cfg.checkpoint.save)
    is_resume = bool(cfg.checkpoint.resume)
    run_dir_guard.check_writable(
        run_dir, is_resume=is_resume, is_overwrite=cfg.checkpoint.overwrite
    )
    with run_dir_guard.hold_lock(run_dir):
        if cfg.checkpoint.overwrite and not is_resume:
            run_dir_guard.clear(run_dir)
        return await _train_in(cfg, run_dir, model_path, source, eval_tasks, progress)


async def _train_in(
    cfg: RunConfig,
    run_dir: Path,
    model_path: str,
    source: TaskSource,
    eval_tasks: list[Any],
    progress: RunProgress,
) -> TrainResult:
    """The run proper, in a validated run directory this process holds the lock of."""
    (run_dir / "rollouts").mkdir(parents=True, exist_ok=True)
    (run_dir / "run_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    progress.note(
        f"run dir {run_dir}: loading {cfg.model.path} and env {cfg.env.id!r} "
        f"({cfg.train.num_rollout} steps of {cfg.rollout.rollout_batch_size} tasks x "
        f"{cfg.rollout.n_samples_per_prompt} episodes)"
    )
    runtime = await make_runtime(cfg, plan_deployment(cfg), model_path)
    logger = MetricsLogger(run_dir, cfg.log, config=cfg.to_dict())
    try:
        runner = build_runner(cfg, runtime.engine, model_path)
        resume = cfg.checkpoint.resume  # a resume printed nothing while a checkpoint loaded (27 s)
        loading = progress.loading(f"the checkpoint in {resume}") if resume else nullcontext()
        with loading:
            start_step, evals = await resume_run(cfg.checkpoint, runtime, source)
        if cfg.checkpoint.resume:  # the steps after the checkpoint are redone: logged once
            logger.truncate_after(start_step)
        state = RunState(
            cfg,
            run_dir,
            runtime,
            runner,
            source,
            eval_tasks,
            logger,
            evals,
            step=start_step,
            progress=progress,
        )
        with stop_on_signals(progress):
            return await _run(state, start_step)
    finally:
        logger.close()
        await runtime.close()


async def _run(state: RunState, start_step: int) -> TrainResult:
    """eval at start -> per step (`_Steps`) -> final eval and save. Where the groups come from is
    the schedule: collected now (sync), one step ahead (`--async`) or from a rollout worker that
    never stops (`--async-mode full`). Ctrl-C or SIGTERM saves the last completed step."""
    cfg = state.cfg
    schedule: SyncSchedule | None = None
    try:
        if start_step == 0 and cfg.eval.eval_at_start and not state.evals:
            await state.run_eval(step=0)
        schedule = make_schedule(state, start_step)
        steps = _Steps(state, schedule)
        for step in range(start_step, cfg.train.num_rollout):
            await steps.run(step)
        await schedule.stop()
        num_steps = max(cfg.train.num_rollout, start_step)
        if not state.evals or state.evals[-1]["step"] != num_steps:
            await state.run_eval(step=num_steps)
        last = await state.save(num_steps)
    except (KeyboardInterrupt, asyncio.CancelledError, EngineMemoryError):
        # EngineMemoryError: the engines cannot take their memory back after a train step; the
        # trainer's step is whole, so it is saved before the run stops with the fix.
        state.progress.note(f"saving step {state.step} (the last completed)…")
        if schedule is not None:
            await schedule.stop()
        await state.save(state.step)
        raise
    return TrainResult(state.run_dir, num_steps, state.evals, last)


class _Steps:
    """One train step after another: take the groups, learn, sync when due, log, then eval and
    save when due (their time belongs to no step's pace)."""

    def __init__(self, state: RunState, schedule: SyncSchedule) -> None:
        self.state = state
        self.schedule = schedule
        self.pace = Pace(state.runtime.engine, state.runner)
        self.step_times: list[float] = []  # the run's ETA: their mean (evals and saves aside)
        self.last_save_t = time.monotonic()

    async def run(self, step: int) -> None:
        state = self.state
        cfg = self.state.cfg
        schedule = self.schedule
        rollout = await schedule.next_rollout(step)
        if problem := why_untrainable(rollout.collected.groups):
            await schedule.stop()
            raise NothingToTrainError(f"step {step + 1}: {problem}; {how_to_go_on(state.run_dir)}")
        t0 = time.perf_counter()
        metrics = await state.learn(step, rollout)
        busy_s = time.perf_counter() - t0
        done = step + 1
        try:
            if not cfg.train.use_async or _is_due(cfg.train.update_weights_interval, done):
                await schedule.before_sync()  # trainer idle: not in busy_s
                t1 = time.perf_counter()
                metrics.update(await state.sync(step))
                busy_s += time.perf_counter() - t1
            metrics.update(self.pace.step_metrics(busy_s, schedule.queue_depth()))
        finally:  # the step is trained and will be saved: its line is there, interrupted or not
            state.logger.log(done, metrics)
        self.step_times.append(metrics["time/step_s"])
        eta_s = sum(self.step_times) / len(self.step_times) * (cfg.train.num_rollout - done)
        state.progress.note(step_line(done, cfg.train.num_rollout, metrics, eta_s))
        if done >= cfg.train.num_rollout:
            return
        if _is_due(cfg.eval.eval_interval, done):
            await state.run_eval(step=done)
            self.pace.restart()
        minutes = cfg.checkpoint.save_interval_minutes  # what a preempted job would lose
        is_overdue = minutes is not None and time.monotonic() - self.last_save_t >= minutes * 60
        if _is_due(cfg.checkpoint.save_interval, done) or is_overdue:
            await state.save(done)
            self.last_save_t = time.monotonic()
            self.pace.restart()


def _is_due(interval: int | None, done: int) -> bool:
    return bool(interval) and done % interval == 0
