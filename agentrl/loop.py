"""`train(config)`: the top-level loop of DESIGN §1 — rollout, filter, train, sync, eval, save."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentrl.config import ConfigError, RunConfig
from agentrl.data import TaskSource, load_tasks
from agentrl.engine.factory import make_engine
from agentrl.eval import evaluate, plot_eval_history
from agentrl.metrics import MetricsLogger, Timer, rollout_metrics
from agentrl.rollout import RolloutRunner, build_runner
from agentrl.rollout.trajectory import write_jsonl
from agentrl.trainer.batch import build_train_batch, filter_zero_variance_groups
from agentrl.trainer.checkpoint import (
    capture_rng_state,
    find_latest,
    restore_rng_state,
    save_checkpoint,
)
from agentrl.trainer.torch_backend import TorchBackend

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    run_dir: Path
    num_steps: int
    evals: list[dict[str, Any]]
    last_checkpoint: Path | None


def train(cfg: RunConfig) -> TrainResult:
    return asyncio.run(_train(cfg))


async def _train(cfg: RunConfig) -> TrainResult:
    if cfg.train.backend != "torch":
        raise ConfigError(
            f"train.backend={cfg.train.backend!r}: only the torch backend exists so far; "
            "use --set train.backend=torch"
        )
    run_dir = Path(cfg.checkpoint.save)
    (run_dir / "rollouts").mkdir(parents=True, exist_ok=True)
    (run_dir / "run_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    # Data first: a bad row should fail in a second, not after the model loads.
    source = TaskSource(load_tasks(cfg.env, "train"), seed=cfg.rollout.seed)
    eval_tasks = load_tasks(cfg.env, "test")[: cfg.eval.num_eval_tasks]
    engine = make_engine(cfg)
    runner = build_runner(cfg, engine)

    backend = TorchBackend(
        _model_path(cfg),
        cfg.train,
        cfg.algo,
        device=cfg.model.device,
        dtype=cfg.model.dtype,
        temperature=cfg.rollout.rollout_temperature,
        num_optimizer_steps=_num_optimizer_steps(cfg),
    )
    logger = MetricsLogger(
        run_dir,
        use_tensorboard=cfg.log.use_tensorboard,
        use_wandb=cfg.log.use_wandb,
        wandb_project=cfg.log.wandb_project,
        config=cfg.to_dict(),
    )
    start_step, evals = await _maybe_resume(cfg, backend, engine, source)
    state = _State(cfg, run_dir, backend, engine, runner, source, eval_tasks, logger, evals)
    state.step = start_step
    try:
        if start_step == 0 and cfg.eval.eval_at_start:
            await state.run_eval(step=0)
        with _progress(cfg, start_step) as bar:
            for step in range(start_step, cfg.train.num_rollout):
                metrics = await state.train_step(step)
                bar.advance(metrics)
                done = step + 1
                if (
                    cfg.eval.eval_interval
                    and done % cfg.eval.eval_interval == 0
                    and done < cfg.train.num_rollout
                ):
                    await state.run_eval(step=done)
                if done % cfg.checkpoint.save_interval == 0 and done < cfg.train.num_rollout:
                    state.save(done)
        steps = max(cfg.train.num_rollout, start_step)
        if not state.evals or state.evals[-1]["step"] != steps:
            await state.run_eval(step=steps)
        last = state.save(steps)
    except (KeyboardInterrupt, asyncio.CancelledError):
        log.warning("interrupted: saving a checkpoint at step %d before exiting", state.step)
        state.save(state.step)
        raise
    finally:
        logger.close()
        await engine.close()
    return TrainResult(run_dir, steps, state.evals, last)


def _num_optimizer_steps(cfg: RunConfig) -> int:
    """The learning-rate schedule's horizon: optimizer steps over the whole run."""
    per_rollout = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    gbs = cfg.train.global_batch_size or per_rollout
    return cfg.train.num_rollout * -(-per_rollout // gbs)


def _model_path(cfg: RunConfig) -> str:
    from agentrl.engine.model_store import resolve_model_path

    return resolve_model_path(cfg.model.path, cfg.model.cache_dir)


class _State:
    """What one run carries between steps; each method is one box of DESIGN §1."""

    def __init__(
        self,
        cfg,
        run_dir,
        backend,
        engine,
        runner: RolloutRunner,
        source,
        eval_tasks,
        logger,
        evals,
    ):
        self.cfg, self.run_dir, self.backend, self.engine = cfg, run_dir, backend, engine
        self.runner, self.source, self.eval_tasks, self.logger = runner, source, eval_tasks, logger
        self.evals: list[dict[str, Any]] = evals
        self.is_resumed = bool(cfg.checkpoint.resume)
        self.step = 0
        # What a checkpoint records: both advance together, only once a step's update is done,
        # so a checkpoint taken on Ctrl-C mid-step replays that step's tasks on resume.
        self.data_state = source.state()

    async def train_step(self, step: int) -> dict[str, float]:
        timer = Timer()
        with timer("rollout"):
            groups, num_dropped = await self.collect_groups(step)
        # Every trajectory trained on is kept, flushed, for `agentrl show` and post-mortems.
        write_jsonl(
            str(self.run_dir / "rollouts" / f"step_{step + 1:06d}.jsonl"),
            [t for g in groups for t in g],
        )
        with timer("train"):
            batch = build_train_batch(
                groups,
                self.cfg.algo,
                max_tokens_per_micro_batch=self.cfg.train.max_tokens_per_micro_batch,
                pad_id=self.backend.pad_id,
                global_batch_size=self.cfg.train.global_batch_size,
            )
            train_metrics = self.backend.train_step(batch)
        self.step, self.data_state = step + 1, self.source.state()
        with timer("weight_sync"):
            await self.sync_weights(version=str(step + 1))
        metrics = {**rollout_metrics(groups), **{f"train/{k}": v for k, v in train_metrics.items()}}
        metrics["rollout/num_zero_variance_groups_dropped"] = float(num_dropped)
        metrics.update({f"time/{k}_s": v for k, v in timer.totals.items()})
        num_tokens = sum(len(t.token_ids) for g in groups for t in g)
        metrics["perf/tokens_per_s"] = num_tokens / max(timer.totals.get("rollout", 0.0), 1e-9)
        self.logger.log(step + 1, metrics)
        return metrics

    async def collect_groups(self, step: int) -> tuple[list[list[Any]], int]:
        """One rollout batch; with dynamic sampling, zero-variance groups are dropped and more
        tasks are sampled (up to `max_sampling_rounds` extra rounds) to refill the batch."""
        rc = self.cfg.rollout
        want = rc.rollout_batch_size
        kept: list[list[Any]] = []
        num_dropped = 0
        for round_index in range(1 + (rc.max_sampling_rounds if rc.dynamic_sampling else 0)):
            tasks = self.source.next_batch(want - len(kept))
            groups = await self.runner.run_groups(
                tasks, rc.n_samples_per_prompt, seed=_rollout_seed(rc.seed, step, round_index)
            )
            if rc.dynamic_sampling:
                groups, dropped = filter_zero_variance_groups(groups)
                num_dropped += dropped
            kept.extend(groups)
            if len(kept) >= want:
                break
        if not kept:
            raise RuntimeError(
                f"step {step}: every group had zero reward variance after {rc.max_sampling_rounds} extra rounds; "
                "raise rollout.max_sampling_rounds or turn off rollout.dynamic_sampling"
            )
        return kept[:want], num_dropped

    async def sync_weights(self, version: str) -> None:
        for bucket in self.backend.export_weights():
            await self.engine.update_weights(bucket, weight_version=version)

    async def run_eval(self, step: int) -> dict[str, Any]:
        out_dir = self.run_dir / "eval" / f"step_{step:06d}"
        report = await evaluate(
            self.runner,
            self.eval_tasks,
            k=self.cfg.eval.n_samples,
            temperature=self.cfg.eval.temperature,
            out_dir=out_dir,
            progress=self.cfg.log.progress,
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

    def save(self, step: int) -> Path:
        extra = {
            "step": step,
            "data": self.data_state,
            "evals": self.evals,
            "config": self.cfg.to_dict(),
            "rng": capture_rng_state(),
        }

        def write(tmp_dir: Path) -> None:
            self.backend.save(tmp_dir)
            torch.save(extra, tmp_dir / "loop_state.pt")

        return save_checkpoint(
            self.run_dir / "checkpoints", step, write, keep_last=self.cfg.checkpoint.keep_last
        )


async def _maybe_resume(
    cfg: RunConfig, backend, engine, source: TaskSource
) -> tuple[int, list[dict[str, Any]]]:
    if not cfg.checkpoint.resume:
        return 0, []
    root = Path(cfg.checkpoint.resume)
    ckpt = (
        find_latest(root / "checkpoints")
        or find_latest(root)
        or (root if (root / "loop_state.pt").exists() else None)
    )
    if ckpt is None:
        raise FileNotFoundError(
            f"--resume {str(root)!r}: no complete checkpoint found there (looked for step_* dirs)"
        )
    backend.load(ckpt)
    extra = torch.load(ckpt / "loop_state.pt", weights_only=False)
    source.load_state(extra["data"])
    restore_rng_state(extra["rng"])
    version = str(extra["step"])
    for bucket in backend.export_weights():
        await engine.update_weights(bucket, weight_version=version)
    log.info("resumed from %s at step %d", ckpt, extra["step"])
    return int(extra["step"]), list(extra.get("evals", []))


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


class _progress:
    """A rich progress bar over train steps with rate, ETA and the last reward."""

    def __init__(self, cfg: RunConfig, start_step: int):
        self.cfg, self.start = cfg, start_step

    def __enter__(self) -> _progress:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            disable=not self.cfg.log.progress,
        )
        self.progress.__enter__()
        self.task = self.progress.add_task(
            "train", total=self.cfg.train.num_rollout, completed=self.start, info=""
        )
        return self

    def advance(self, metrics: dict[str, float]) -> None:
        info = f"reward {metrics.get('rollout/reward_mean', float('nan')):.3f}"
        self.progress.update(self.task, advance=1, info=info)

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)
