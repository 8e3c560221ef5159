"""`RunState`: what one run carries between train steps, and the boxes of one step (DESIGN §1)
-- collect the step's groups, learn from them, sync the weights, evaluate, save."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import pydantic_core

from agentrl.config import RunConfig
from agentrl.data import TaskSource
from agentrl.deploy.runtime import Runtime
from agentrl.eval import evaluate, plot_eval_history
from agentrl.progress import RunProgress
from agentrl.rollout import RolloutRunner
from agentrl.rollout.collect import collect_groups
from agentrl.rollout.staleness import lag_gap_metrics, probe_sample, staleness_metrics
from agentrl.run.checkpoint import save_run
from agentrl.run.metrics import MetricsLogger, rollout_metrics
from agentrl.run.schedules import NothingToTrainError, Rollout, nothing_to_train, rollout_seed
from agentrl.trainer.batch import build_train_batches, sampling_masks
from agentrl.types import Group, write_jsonl


class RunState:
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
        *,
        step: int = 0,
        progress: RunProgress | None = None,
    ):
        self.cfg = cfg
        self.run_dir = run_dir
        self.runtime = runtime
        self.runner = runner
        self.source = source
        self.eval_tasks = eval_tasks
        self.logger = logger
        self.evals: list[dict[str, Any]] = evals
        self.progress = progress or RunProgress(enabled=False)
        self.is_resumed = bool(cfg.checkpoint.resume)
        self.step = step  # policy version: the train steps done
        # What a checkpoint records: both advance together, only once a step's update is done,
        # so a checkpoint taken on Ctrl-C mid-step replays that step's tasks on resume.
        self.data_state = source.state()

    async def collect(self, step: int, *, is_shown: bool = False) -> Rollout:
        """The step's groups, and the data cursor just past its tasks (what a checkpoint taken
        after this step records, even while the next step's tasks are already drawn).
        `is_shown`: the progress display follows it (a rollout ahead of training is not)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        num_episodes = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
        name = f"step {step + 1}/{cfg.train.num_rollout} rollout"
        work = self.runner.sampled_tokens  # tokens sampled, and the most a step samples
        max_work = num_episodes * cfg.rollout.max_turns * cfg.rollout.rollout_max_response_len
        shown = (
            self.progress.phase(
                name, num_episodes, "episodes", kind="rollout", work=work, max_work=max_work
            )
            if is_shown
            else contextlib.nullcontext(None)
        )
        with shown as phase:
            collected = await collect_groups(
                self.runner,
                self.source,
                cfg.rollout,
                seed_for_round=lambda r: rollout_seed(cfg.rollout.seed, step, r),
                max_rerun_rounds=cfg.cluster.max_rerun_rounds,
                heal=self.runtime.heal_engines,
                on_episode=None if phase is None else lambda _: phase.advance(),
            )
        if not collected.groups:  # dynamic sampling dropped them all: failed, or tied
            raise NothingToTrainError(nothing_to_train(step, collected, cfg.rollout, self.run_dir))
        return Rollout(collected, self.source.state(), time.perf_counter() - t0)

    async def learn(self, step: int, rollout: Rollout) -> dict[str, float]:
        """Write the step's trajectories (none past the staleness bound: `take_groups`), train on
        them; metrics (logged by the caller). The trainer is at policy version `step`."""
        cfg = self.cfg
        groups = rollout.collected.groups
        # Every trajectory trained on is kept, flushed, for `agentrl show` and post-mortems.
        write_jsonl(
            str(self.run_dir / "rollouts" / f"step_{step + 1:06d}.jsonl"),
            [t for g in groups for t in g],
        )
        t0 = time.perf_counter()
        metrics = await self.offpolicy_metrics(groups, step) if cfg.train.use_async else {}
        train_metrics, is_interrupted = await self._update(step, groups)
        self.step = step + 1
        self.data_state = rollout.data_state
        metrics.update(_step_metrics(groups, step, rollout, train_metrics))
        metrics["time/train_s"] = time.perf_counter() - t0
        if is_interrupted:  # the step counts and is saved on the way out: so is its line
            self.logger.log(step + 1, metrics)
            raise asyncio.CancelledError
        return metrics

    async def _update(self, step: int, groups: list[Group]) -> tuple[dict[str, float], bool]:
        """One optimizer update on `groups`; its metrics, and whether an interrupt came."""
        cfg = self.cfg
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
        with self.progress.phase(name, num_tokens, "tokens", kind="train") as phase:
            update = asyncio.ensure_future(self.runtime.train_step(batches))
            try:
                train_metrics = await asyncio.shield(update)
                is_interrupted = False
            except asyncio.CancelledError:
                # Interrupted mid-update: the weights are changing on a worker; let the step
                # finish and count it, so the checkpoint taken on the way out holds whole steps.
                train_metrics = await update
                is_interrupted = True
            phase.advance(num_tokens)
        return train_metrics, is_interrupted

    async def offpolicy_metrics(self, groups: list[Group], step: int) -> dict[str, float]:
        """Train-vs-rollout logprob gap and TIS clip fraction by version lag, on a few
        trajectories per lag scored by the trainer before this step's update."""
        probes = []
        for traj in probe_sample(groups, step, per_lag=2):
            masks = sampling_masks(traj.turns, len(traj.token_ids) - 1)  # as the trainer replays
            scored = await self.runtime.policy_logprobs(traj.token_ids, traj.prompt_len, masks)
            mask = traj.loss_mask[traj.prompt_len :]
            probes.append((traj, [lp for lp, m in zip(scored, mask, strict=True) if m]))
        return lag_gap_metrics(probes, step, self.cfg.algo.tis_cap)

    async def sync(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics = await self.runtime.sync_weights(version=step + 1)
        return {**metrics, "time/weight_sync_s": time.perf_counter() - t0}

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
        # NaN (every episode of an eval errored) as null, so the JSON stays valid
        history = pydantic_core.to_json(self.evals, indent=2, inf_nan_mode="null")
        (self.run_dir / "eval_history.json").write_bytes(history)
        plot_eval_history(self.evals, self.run_dir / "eval_history.png", env=self.cfg.env.id)
        return summary

    async def save(self, step: int) -> Path:
        loop_state = {
            "step": step,
            "data": self.data_state,
            "evals": self.evals,
            "config": self.cfg.to_dict(),
        }
        return await save_run(self.run_dir, self.runtime, loop_state, self.cfg.checkpoint.keep_last)


def _step_metrics(
    groups: list[Group], step: int, rollout: Rollout, trained: dict[str, float]
) -> dict[str, float]:
    """What one step logs of its groups, of how they were collected, and of the update."""
    collected = rollout.collected
    num_tokens = sum(len(t.token_ids) for g in groups for t in g)
    return {
        **rollout_metrics(groups),
        **_prefixed("train/", trained),
        **staleness_metrics(groups, step),
        "rollout/num_zero_variance_groups_dropped": float(collected.num_zero_variance_dropped),
        "rollout/num_stale_dropped": float(collected.num_stale_dropped),
        "rollout/num_engine_reruns": float(collected.num_engine_reruns),
        "engine/num_restarts": float(collected.num_engine_restarts),
        "time/rollout_s": rollout.seconds,
        "perf/tokens_per_s": num_tokens / max(rollout.seconds, 1e-9),
    }


def _prefixed(prefix: str, metrics: dict[str, float]) -> dict[str, float]:
    keep = ("time/", "weight_sync/", "engine/")  # the runtime's own, already named
    return {k if k.startswith(keep) else prefix + k: v for k, v in metrics.items()}
