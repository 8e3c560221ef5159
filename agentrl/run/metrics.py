"""Training metrics: `rollout_metrics` over trajectory groups, `MetricsLogger` (JSONL,
TensorBoard, wandb)."""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, BinaryIO

import pydantic_core

from agentrl.config import LogConfig
from agentrl.eval import stats
from agentrl.types import EpisodeStatus, Group, Trajectory


def rollout_metrics(groups: Sequence[Group]) -> dict[str, float]:
    """Scalars over the groups of one rollout batch.

    Reward, pass rate and group statistics use scored episodes only (COMPLETED,
    TRUNCATED); ERROR and ABORTED count in the status fractions, never as reward 0.
    Length and tool statistics are per episode over all episodes that produced tokens.
    """
    episodes = [t for g in groups for t in g]
    scored = [t for t in episodes if stats.is_scored(t)]
    rewards = [t.reward for t in scored]
    status_counts = Counter(EpisodeStatus(t.status) for t in episodes)
    total = max(1, len(episodes))
    response_lens = [t.response_len for t in episodes]
    group_rewards = [[t.reward for t in g if stats.is_scored(t)] for g in groups]
    num_compared = sum(len(r) > 1 for r in group_rewards)  # one alone cannot tie
    # groups whose scored rewards all match: GRPO gives them advantage 0, no signal
    num_tied = sum(len(r) > 1 and max(r) == min(r) for r in group_rewards)
    out = {
        "num_groups": float(len(groups)),
        "num_episodes": float(len(episodes)),
        "num_scored_episodes": float(len(scored)),
        "reward_mean": _mean(rewards),
        "reward_std": stats.std(rewards),
        "pass_rate": _mean([float(stats.is_correct(t)) for t in scored]),
        "zero_std_group_fraction": num_tied / num_compared if num_compared else math.nan,
        "num_zero_variance_groups": float(num_tied),
        "truncated_ratio": status_counts[EpisodeStatus.TRUNCATED] / total,
        "turns_mean": _mean([t.num_turns for t in episodes]),
        "tool_calls_per_episode": _mean([stats.num_tool_calls(t) for t in episodes]),
        "tool_errors_per_episode": _mean([stats.num_tool_errors(t) for t in episodes]),
        "response_len_mean": _mean(response_lens),
        "response_len_max": float(max(response_lens, default=0)),
        "num_sampled_tokens": float(sum(t.num_sampled for t in episodes)),
    }
    out.update({f"status/{s.value}": status_counts[s] / total for s in EpisodeStatus})
    out.update(_routing_metrics(episodes))
    return {"rollout/" + k: v for k, v in out.items()}


def _routing_metrics(episodes: Sequence[Trajectory]) -> dict[str, float]:
    """Over engine servers (none in process): how many served episodes this batch, and how many
    episodes had turns on more than one (0 unless routing by episode key is broken)."""
    servers = [{turn.served_by for turn in t.turns if turn.served_by} for t in episodes]
    if not any(servers):
        return {}
    return {
        "num_serving_engines": float(len(set().union(*servers))),
        "num_split_episodes": float(sum(len(s) > 1 for s in servers)),
    }


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan


class MetricsLogger:
    """`log(step, metrics)` appends one JSON line to `run_dir/metrics.jsonl` (flushed), and
    writes numeric values as TensorBoard scalars and to wandb when asked. A resumed run calls
    `truncate_after(step)` first.

    Files open on the first `log`, so constructing a logger does no I/O.
    """

    def __init__(
        self,
        run_dir: str | Path,
        log: LogConfig | None = None,
        *,
        config: dict[str, Any] | None = None,
    ) -> None:
        """`log`: the run's log section (`config_checks.check_run` checked its extras are
        installed); `config`: the run config, shown in TensorBoard and wandb."""
        self.log_cfg = log or LogConfig()
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.config = dict(config or {})
        self._jsonl: BinaryIO | None = None
        self._tb: Any = None
        self._wandb_run: Any = None
        self._purge_step: int | None = None
        self._opened = ExitStack()  # what _open opened, for close

    def _open(self) -> BinaryIO:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Append: a resumed run continues the file. It stays open across log() calls.
        self._jsonl = jsonl = self._opened.enter_context(open(self.path, "ab"))  # noqa: SIM115
        if self.log_cfg.use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides the earlier files' events from that step on.
            self._tb = SummaryWriter(
                log_dir=str(self.run_dir / "tensorboard"), purge_step=self._purge_step
            )
            self._opened.callback(self._tb.close)
            if self.config:
                self._tb.add_text(
                    "config", "```\n" + json.dumps(self.config, indent=2, default=str) + "\n```"
                )
        if self.log_cfg.use_wandb:
            import wandb  # pyright: ignore[reportMissingImports]  (the wandb extra)

            self._wandb_run = wandb.init(
                project=self.log_cfg.wandb_project, config=self.config, dir=str(self.run_dir)
            )
            self._opened.callback(self._wandb_run.finish)
        return jsonl

    def truncate_after(self, step: int) -> None:
        """A run resumed from the checkpoint of `step` redoes the steps after it: the lines the
        interrupted run wrote for them are dropped, so each step appears once — metrics.jsonl is
        rewritten (a line cut short by a crash goes too) and TensorBoard, reading the new event
        file's `purge_step`, hides the old files' events past `step`. Call before `log`."""
        if self._jsonl is not None:
            raise RuntimeError("MetricsLogger.truncate_after must come before the first log()")
        self._purge_step = step + 1
        if not self.path.is_file():
            return
        kept = [line for line in self.path.read_text("utf-8").splitlines() if _is_kept(line, step)]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        jsonl = self._jsonl if self._jsonl is not None else self._open()
        record = {"step": step, "time": time.time(), **metrics}
        # NaN and inf as null, so every line is strict JSON
        jsonl.write(pydantic_core.to_json(record, inf_nan_mode="null", fallback=str) + b"\n")
        jsonl.flush()
        scalars = {k: float(v) for k, v in metrics.items() if _is_number(v)}
        if self._tb is not None:
            for name, value in scalars.items():
                self._tb.add_scalar(name, value, global_step=step)
            self._tb.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(scalars, step=step)

    def close(self) -> None:
        self._opened.close()
        self._jsonl = self._tb = self._wandb_run = None


def _is_kept(line: str, max_step: int) -> bool:
    """Whether a metrics.jsonl line is a whole record of a step up to `max_step`."""
    try:
        step = json.loads(line)["step"]
    except (json.JSONDecodeError, TypeError, KeyError):  # cut short, or not a step's record
        return False
    return isinstance(step, int) and step <= max_step


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
