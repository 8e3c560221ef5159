"""`train(config)`: the top-level loop of DESIGN §1 — rollout, filter, train, sync, eval, save."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentrl import run_dir as run_dir_guard
from agentrl.config import ConfigError, RunConfig
from agentrl.config_checks import check_run
from agentrl.data import TaskSource, load_tasks
from agentrl.engine.base import EngineMemoryError
from agentrl.envs import spec
from agentrl.eval import evaluate, plot_eval_history
from agentrl.loop_async import Pace, Rollout, Schedule, check_async, make_schedule
from agentrl.metrics import MetricsLogger, num_tied_groups, rollout_metrics
from agentrl.progress import RunProgress, StepClock, sampled_tokens, step_line
from agentrl.rollout import RolloutRunner, build_runner
from agentrl.rollout.collect import collect_groups
from agentrl.rollout.staleness import drop_stale, lag_gap_metrics, probe_sample, staleness_metrics
from agentrl.rollout.trajectory import write_jsonl
from agentrl.run_checkpoint import resume_run, save_run
from agentrl.runtime import Runtime, make_runtime, uses_ray
from agentrl.trainer.batch import build_train_batches

log = logging.getLogger(__name__)


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


def _check_megatron(cfg: RunConfig) -> None:
    """What the machine lacks, before anything starts: the megatron extra, CUDA, a TP x PP that
    divides the trainer's GPUs, TransformerEngine for sequence parallel."""
    from agentrl.trainer.megatron import MegatronUnavailable, check_megatron_usable

    gpus = cfg.cluster.actor_num_nodes * cfg.cluster.actor_num_gpus_per_node
    try:
        check_megatron_usable(cfg.train, gpus)
    except MegatronUnavailable as e:
        raise ConfigError(str(e)) from None


async def _train(cfg: RunConfig, progress: RunProgress) -> TrainResult:
    if cfg.train.backend == "megatron":
        _check_megatron(cfg)
    # Everything a user can get wrong fails first, in a second, before anything is written:
    # flags, the env id and its data rows, the model path.
    _check_async(cfg)
    check_run(cfg)
    env_spec = spec(cfg.env.id)
    env_spec.check_kwargs(cfg.env.kwargs)
    env_cls = env_spec.load_class()
    source = TaskSource(load_tasks(cfg.env, "train", env_cls), seed=cfg.rollout.seed)
    eval_tasks = load_tasks(cfg.env, "test", env_cls)[: cfg.eval.num_eval_tasks]
    model_path = _model_path(cfg)
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
    runtime = await make_runtime(cfg, model_path, _num_optimizer_steps(cfg))
    logger = MetricsLogger(
        run_dir,
        use_tensorboard=cfg.log.use_tensorboard,
        use_wandb=cfg.log.use_wandb,
        wandb_project=cfg.log.wandb_project,
        config=cfg.to_dict(),
    )
    try:
        runner = build_runner(cfg, runtime.engine)
        start_step, evals = await resume_run(cfg, runtime, source)
        if cfg.checkpoint.resume:  # the steps after the checkpoint are redone: logged once
            logger.truncate_after(start_step)
        state = _State(cfg, run_dir, runtime, runner, source, eval_tasks, logger, evals)
        state.step, state.progress = start_step, progress
        with _stop_on_signals(progress):
            return await _run(state, start_step)
    finally:
        logger.close()
        await runtime.close()


async def _run(state: _State, start_step: int) -> TrainResult:
    """eval at start -> per step: take the step's groups, build batch, train, sync weights, eval /
    save when due -> final eval and save. Where the groups come from is the schedule: collected
    now (sync), one step ahead (`--async`) or from a rollout worker that never stops
    (`--async-mode full`). Ctrl-C or SIGTERM saves the last completed step."""
    cfg = state.cfg
    schedule: Schedule | None = None
    try:
        if start_step == 0 and cfg.eval.eval_at_start and not state.evals:
            await state.run_eval(step=0)
        schedule = make_schedule(state, start_step)
        last_save_t = time.monotonic()
        pace = Pace(state.runtime.engine, state.runner)
        clock = StepClock(start_step, cfg.train.num_rollout)
        for step in range(start_step, cfg.train.num_rollout):
            rollout = await schedule.next_rollout(step)
            t0 = time.perf_counter()
            metrics = await state.learn(step, rollout)
            busy_s, done = time.perf_counter() - t0, step + 1
            try:
                if not cfg.train.use_async or _is_due(cfg.train.update_weights_interval, done):
                    await schedule.before_sync()  # trainer idle: not in busy_s
                    t1 = time.perf_counter()
                    metrics.update(await state.sync(step))
                    busy_s += time.perf_counter() - t1
                metrics.update(pace.step_metrics(busy_s, schedule.queue_depth()))
            finally:  # the step is trained and will be saved: its line is there, interrupted or not
                state.logger.log(done, metrics)
            state.progress.note(step_line(done, cfg.train.num_rollout, metrics, clock.done()))
            if done < cfg.train.num_rollout and _is_due(cfg.eval.eval_interval, done):
                await state.run_eval(step=done)
                pace.restart()  # evaluation is no train step's time
                clock.pause()
            if done < cfg.train.num_rollout and _is_save_due(cfg, done, last_save_t):
                await state.save(done)
                last_save_t = time.monotonic()
                pace.restart()
                clock.pause()
        await schedule.stop()
        steps = max(cfg.train.num_rollout, start_step)
        if not state.evals or state.evals[-1]["step"] != steps:
            await state.run_eval(step=steps)
        last = await state.save(steps)
    except (KeyboardInterrupt, asyncio.CancelledError, EngineMemoryError):
        # EngineMemoryError: the engines cannot take their memory back after a train step; the
        # trainer's step is whole, so it is saved before the run stops with the fix.
        state.progress.note(f"saving step {state.step} (the last completed)…")
        if schedule is not None:
            await schedule.stop()
        await state.save(state.step)
        raise
    return TrainResult(state.run_dir, steps, state.evals, last)


def _check_async(cfg: RunConfig) -> None:
    device = cfg.model.device
    is_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    check_async(cfg, is_ray=uses_ray(cfg), is_cuda=is_cuda)
    if cfg.algo.use_tis is None:  # async turns come from older policies: correct for it
        cfg.algo.use_tis = cfg.train.use_async


def _is_due(interval: int | None, done: int) -> bool:
    return bool(interval) and done % interval == 0


def _is_save_due(cfg: RunConfig, done: int, last_save_t: float) -> bool:
    """Every `save_interval` steps, or once `save_interval_minutes` of wall clock have passed
    since the last save (what a preempted job would otherwise lose)."""
    minutes = cfg.checkpoint.save_interval_minutes
    is_overdue = minutes is not None and time.monotonic() - last_save_t >= minutes * 60
    return _is_due(cfg.checkpoint.save_interval, done) or is_overdue


@contextlib.contextmanager
def _stop_on_signals(progress: RunProgress) -> Iterator[None]:
    """Ctrl-C and SIGTERM (a scheduler's preemption) stop the run alike: say so at once, cancel
    the run (a weight update under way finishes first, see `_State.learn`), save the last
    completed step, stop every worker. A second signal only says the save is still going."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    if task is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}
    is_stopping = False

    def stop(name: str) -> None:
        nonlocal is_stopping
        if is_stopping:
            progress.note(f"{name} again: still saving the checkpoint, please wait")
            return
        is_stopping = True
        progress.note(f"{name}: finishing the current step…")
        task.cancel()

    for signum, name in signals.items():
        loop.add_signal_handler(signum, stop, name)
    try:
        yield
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)


def _num_optimizer_steps(cfg: RunConfig) -> int:
    """The learning-rate schedule's horizon: optimizer steps over the whole run."""
    per_rollout = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    gbs = cfg.train.global_batch_size or per_rollout
    return cfg.train.num_rollout * -(-per_rollout // gbs)


def _model_path(cfg: RunConfig) -> str:
    from agentrl.model_store import resolve_model_path

    return resolve_model_path(cfg.model.path, cfg.model.cache_dir)


class _State:
    """What one run carries between steps; each method is one box of DESIGN §1."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        runtime: Runtime,
        runner: RolloutRunner,
        source: TaskSource,
        eval_tasks: list[Any],
        logger: MetricsLogger,
        evals: list[dict[str, Any]],
    ):
        self.cfg, self.run_dir, self.runtime = cfg, run_dir, runtime
        self.runner, self.source, self.eval_tasks, self.logger = runner, source, eval_tasks, logger
        self.evals: list[dict[str, Any]] = evals
        self.progress = RunProgress(enabled=False)
        self.is_resumed = bool(cfg.checkpoint.resume)
        self.step = 0
        # What a checkpoint records: both advance together, only once a step's update is done,
        # so a checkpoint taken on Ctrl-C mid-step replays that step's tasks on resume.
        self.data_state = source.state()

    async def collect(self, step: int, *, is_shown: bool = False) -> Rollout:
        """The step's groups, and the data cursor just past its tasks (what a checkpoint taken
        after this step records, even while the next step's tasks are already drawn).
        `is_shown`: the progress display follows it (a rollout ahead of training is not)."""
        cfg, t0 = self.cfg, time.perf_counter()
        num_episodes = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
        name = f"step {step + 1}/{cfg.train.num_rollout} rollout"
        shown = (
            self.progress.phase(
                name,
                num_episodes,
                "episodes",
                kind="rollout",
                work=sampled_tokens(self.runtime.engine),
                max_work=num_episodes
                * cfg.rollout.max_turns
                * cfg.rollout.rollout_max_response_len,
            )
            if is_shown
            else contextlib.nullcontext(None)
        )
        with shown as phase:
            collected = await collect_groups(
                self.runner,
                self.source,
                cfg.rollout,
                seed_for_round=lambda r: _rollout_seed(cfg.rollout.seed, step, r),
                max_rerun_rounds=cfg.cluster.max_rerun_rounds,
                heal=self.runtime.heal_engines,
                on_episode=None if phase is None else lambda _: phase.advance(),
            )
        if not collected.groups:
            raise RuntimeError(
                f"step {step}: every group had zero reward variance after "
                f"{cfg.rollout.max_sampling_rounds} extra rounds; raise rollout.max_sampling_rounds "
                "or turn off rollout.dynamic_sampling"
            )
        return Rollout(collected, self.source.state(), time.perf_counter() - t0)

    async def learn(self, step: int, rollout: Rollout) -> dict[str, float]:
        """Drop trajectories past the staleness bound, write the rest, train on them; metrics
        (logged by the caller). The trainer is at policy version `step` (its updates so far)."""
        cfg, collected = self.cfg, rollout.collected
        groups, num_stale = drop_stale(collected.groups, step, cfg.train.max_staleness)
        if not groups:
            raise RuntimeError(
                f"step {step}: every trajectory is more than --max-staleness="
                f"{cfg.train.max_staleness} policy versions old; raise --max-staleness"
            )
        # Every trajectory trained on is kept, flushed, for `agentrl show` and post-mortems.
        write_jsonl(
            str(self.run_dir / "rollouts" / f"step_{step + 1:06d}.jsonl"),
            [t for g in groups for t in g],
        )
        t0 = time.perf_counter()
        metrics = await self.offpolicy_metrics(groups, step) if cfg.train.use_async else {}
        batches = build_train_batches(
            groups,
            cfg.algo,
            max_tokens_per_micro_batch=cfg.train.max_tokens_per_micro_batch,
            pad_id=self.runtime.pad_id,
            global_batch_size=cfg.train.global_batch_size,
            dp_size=self.runtime.dp_size,
            micro_batch_size=cfg.train.micro_batch_size,
        )
        num_tokens = batches[0].metrics.get("batch/num_packed_tokens", 0.0)
        name = f"step {step + 1}/{cfg.train.num_rollout} train"
        is_interrupted = False
        with self.progress.phase(name, num_tokens, "tokens", kind="train") as phase:
            update = asyncio.ensure_future(self.runtime.train_step(batches))
            try:
                train_metrics = await asyncio.shield(update)
            except asyncio.CancelledError:
                # Interrupted mid-update: the weights are changing on a worker; let the step
                # finish and count it, so the checkpoint taken on the way out holds whole steps.
                train_metrics, is_interrupted = await update, True
            phase.advance(num_tokens)
        self.step, self.data_state = step + 1, rollout.data_state
        metrics.update({**rollout_metrics(groups), **_prefixed("train/", train_metrics)})
        metrics.update(staleness_metrics(groups, step))
        metrics["rollout/num_zero_variance_groups"] = float(num_tied_groups(groups))
        metrics.update(
            {
                "rollout/num_zero_variance_groups_dropped": float(
                    collected.num_zero_variance_dropped
                ),
                "rollout/num_stale_dropped": float(collected.num_stale_dropped + num_stale),
                "rollout/num_engine_reruns": float(collected.num_engine_reruns),
                "engine/num_restarts": float(collected.num_engine_restarts),
                "time/rollout_s": rollout.seconds,
                "time/train_s": time.perf_counter() - t0,
            }
        )
        num_tokens = sum(len(t.token_ids) for g in groups for t in g)
        metrics["perf/tokens_per_s"] = num_tokens / max(rollout.seconds, 1e-9)
        if is_interrupted:  # the step counts and is saved on the way out: so is its line
            self.logger.log(step + 1, metrics)
            raise asyncio.CancelledError
        return metrics

    async def offpolicy_metrics(self, groups: list[Any], step: int) -> dict[str, float]:
        """Train-vs-rollout logprob gap and TIS clip fraction by version lag, on a few
        trajectories per lag scored by the trainer before this step's update."""
        probes = []
        for traj in probe_sample(groups, step, per_lag=2):
            scored = await self.runtime.policy_logprobs(traj.token_ids, traj.prompt_len)
            mask = traj.loss_mask[traj.prompt_len :]
            probes.append((traj, [lp for lp, m in zip(scored, mask, strict=True) if m]))
        return lag_gap_metrics(probes, step, self.cfg.algo.tis_cap)

    async def sync(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics = await self.runtime.sync_weights(version=str(step + 1))
        return {**metrics, "time/weight_sync_s": time.perf_counter() - t0}

    async def train_step(self, step: int) -> dict[str, float]:
        """One synchronous step: collect, learn, sync, log (tests and tools drive it directly)."""
        metrics = await self.learn(step, await self.collect(step))
        metrics.update(await self.sync(step))
        self.logger.log(step + 1, metrics)
        return metrics

    async def run_eval(self, step: int) -> dict[str, Any]:
        out_dir = self.run_dir / "eval" / f"step_{step:06d}"
        await self.runtime.heal_engines()
        report = await evaluate(
            self.runner,
            self.eval_tasks,
            k=self.cfg.eval.n_samples,
            temperature=self.cfg.eval.temperature,
            out_dir=out_dir,
            progress=self.progress if self.cfg.log.progress else False,
            resume=self.is_resumed,
            meta={"env": self.cfg.env.id, "model": self.cfg.model.path, "step": step},
        )
        summary = {"step": step, **report.summary()}
        self.evals.append(summary)
        self.logger.log(
            step, {f"eval/{k}": v for k, v in summary.items() if isinstance(v, (int, float))}
        )
        (self.run_dir / "eval_history.json").write_text(json.dumps(_finite(self.evals), indent=2))
        plot_eval_history(self.evals, self.run_dir / "eval_history.png")
        return summary

    async def save(self, step: int) -> Path:
        loop_state = {"step": step, "data": self.data_state, "evals": self.evals,
                      "config": self.cfg.to_dict()}  # fmt: skip
        return await save_run(self.run_dir, self.runtime, loop_state, self.cfg.checkpoint.keep_last)


def _prefixed(prefix: str, metrics: dict[str, float]) -> dict[str, float]:
    keep = ("time/", "weight_sync/", "engine/")  # the runtime's own, already named
    return {k if k.startswith(keep) else prefix + k: v for k, v in metrics.items()}


def _finite(value: Any) -> Any:
    """NaN (every episode of an eval errored) as null, so the JSON stays valid."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _rollout_seed(seed: int, step: int, round_index: int) -> int:
    return (seed * 1_000_003 + step * 101 + round_index) % (2**31)
