"""Paired comparison of two evaluations on the same held-out tasks (before and after training):
per metric, the mean per-task difference with a 95% interval."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from agentrl.eval import stats
from agentrl.eval.runner import TRAJECTORIES_FILE
from agentrl.eval.stats import Interval
from agentrl.types import Group, read_jsonl


def task_metrics(groups: Sequence[Group]) -> dict[str, dict[str, float]]:
    """metric -> task id -> the mean over the task's scored episodes: `reward`, `pass_rate`
    (the env's `correct`) and each reward component. Tasks without a scored episode are left out."""
    out: dict[str, dict[str, float]] = {}
    for group in groups:
        scored = [t for t in group if stats.is_scored(t)]
        if not scored:
            continue
        task_id = str(scored[0].task.get("id", ""))
        rows = [
            {
                "reward": float(t.reward),
                "pass_rate": float(stats.is_correct(t)),
                **stats.reward_components(t),
            }
            for t in scored
        ]
        for name in dict.fromkeys(k for row in rows for k in row):
            values = [row[name] for row in rows if name in row]
            out.setdefault(name, {})[task_id] = math.fsum(values) / len(values)
    return out


def compare(before: Sequence[Group], after: Sequence[Group]) -> dict[str, Interval]:
    """metric -> mean of (after - before) over the tasks both evaluations scored, with a
    Student-t 95% interval on the per-task differences."""
    a = task_metrics(before)
    b = task_metrics(after)
    return {name: stats.paired_diff_ci(a[name], b[name]) for name in a if name in b}


def load_groups(eval_dir: str | Path) -> list[Group]:
    """The episodes of one evaluation (its `eval_trajectories.jsonl`), grouped by task id."""
    path = Path(eval_dir) / TRAJECTORIES_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist; pass a directory `agentrl eval` or `agentrl train` wrote "
            "(e.g. RUN/eval/step_000000)"
        )
    groups: dict[str, Group] = {}
    for traj in read_jsonl(str(path)):
        groups.setdefault(str(traj.task.get("id", "")), []).append(traj)
    return list(groups.values())


def compare_dirs(before: str | Path, after: str | Path) -> dict[str, Interval]:
    return compare(load_groups(before), load_groups(after))


def format_diff(name: str, iv: Interval) -> str:
    """`reward +0.062 [0.021, 0.103] (n=64 tasks)`."""
    return f"{name} {iv.mean:+.3f} [{iv.low:+.3f}, {iv.high:+.3f}] (n={iv.n} tasks)"
