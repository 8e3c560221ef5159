"""`EvalReport`: the numbers of one held-out evaluation, built from trajectory groups and
written as report.json, report.md and report.png (`plot_eval_history`, reward vs step, is
`agentrl.eval.plots`')."""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pydantic_core

from agentrl.eval import plots, stats
from agentrl.eval.plots import plot_eval_history
from agentrl.eval.stats import Interval
from agentrl.types import EpisodeStatus, Group, StatusReason

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "EvalReport",
    "build_report",
    "format_value",
    "plot_eval_history",
    "plot_report",
    "write_text_atomic",
]


@dataclass
class EvalReport:
    """Rewards and pass rates count scored episodes only (COMPLETED, TRUNCATED); ERROR and
    ABORTED appear in the status mix. Reward and pass@k intervals are over per-task means
    (episodes of one task are not independent): Student t, or Wilson when every task's
    value is 0 or 1; the pass rate interval is Wilson over scored episodes; maj@k is Wilson
    over tasks."""

    k: int
    temperature: float
    num_tasks: int
    num_episodes: int
    num_scored_episodes: int
    reward: Interval
    reward_std: float
    pass_rate: Interval
    pass_at_k: dict[int, Interval]
    maj_at_k: Interval
    status_counts: dict[str, int]
    status_reason_counts: dict[str, int]
    turns_mean: float
    tool_calls_per_episode: float
    tool_errors_per_episode: float
    response_len_mean: float
    tool_calls: Interval | None = None
    """Tool calls per episode over per-task means, with its interval (None in old reports)."""
    components: dict[str, Interval] = field(default_factory=dict)
    """Means of what the env reports beside its reward (`info["reward_components"]`, e.g.
    search_r1's em, format and is_answered), each over per-task means like `reward`."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Who produced it: env, split, model, train step, wall time..."""

    @property
    def status_mix(self) -> dict[str, float]:
        total = max(1, self.num_episodes)
        return {s.value: self.status_counts.get(s.value, 0) / total for s in EpisodeStatus}

    # ------------------------------------------------------------ serialisation

    def to_dict(self) -> dict[str, Any]:
        """Strict JSON values (pydantic's serializer): NaN and inf become null, keys text."""
        out = pydantic_core.to_jsonable_python(self, inf_nan_mode="null", fallback=str)
        return {**out, "status_mix": self.status_mix}

    def summary(self, prefix: str = "") -> dict[str, float]:
        """Flat scalars for a metrics logger or an eval history (see `plot_eval_history`)."""
        out = {
            "reward_mean": self.reward.mean,
            "reward_ci_low": self.reward.low,
            "reward_ci_high": self.reward.high,
            "reward_std": self.reward_std,
            "pass_rate": self.pass_rate.mean,
            f"maj@{self.k}": self.maj_at_k.mean,
            "turns_mean": self.turns_mean,
            "tool_calls_per_episode": self.tool_calls_per_episode,
            "tool_errors_per_episode": self.tool_errors_per_episode,
            "response_len_mean": self.response_len_mean,
            "num_episodes": float(self.num_episodes),
        }
        out.update({f"pass@{k}": v.mean for k, v in self.pass_at_k.items()})
        intervals = {"pass_rate": self.pass_rate, "tool_calls": self.tool_calls}
        intervals.update(self.components)
        for name, iv in intervals.items():
            if iv is not None:
                out.update({f"{name}_ci_low": iv.low, f"{name}_ci_high": iv.high})
        if self.tool_calls is not None:  # over per-task means, as its interval
            out["tool_calls_mean"] = self.tool_calls.mean
        out.update({f"{name}_mean": v.mean for name, v in self.components.items()})
        out.update({f"status/{s}": frac for s, frac in self.status_mix.items()})
        return {prefix + k: float(v) for k, v in out.items()}

    def rows(self, *, components: bool = True) -> list[tuple[str, Interval]]:
        """(name, interval) of each number the tables (and, components aside, the plot) show."""
        rows = [("reward", self.reward), ("pass rate", self.pass_rate)]
        rows += [(f"pass@{k}", v) for k, v in self.pass_at_k.items()]
        rows.append((f"maj@{self.k}", self.maj_at_k))
        if components:
            rows += [(f"{name} (component)", v) for name, v in self.components.items()]
        return rows

    def to_markdown(self) -> str:
        title = " · ".join(
            f"{k} {v}" for k, v in self.meta.items() if k in ("env", "split", "model", "step")
        )
        rows = [("reward (mean)", self.reward), *self.rows()[1:]]
        lines = [
            f"# Evaluation{': ' + title if title else ''}",
            "",
            f"{self.num_tasks} tasks × k={self.k} episodes at temperature {self.temperature}; "
            f"{self.num_scored_episodes} of {self.num_episodes} episodes scored.",
            "",
            "| metric | value | 95% CI | n |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {name} | {format_value(iv.mean)} | [{format_value(iv.low)}, "
            f"{format_value(iv.high)}] | {iv.n} |"
            for name, iv in rows
        ]
        lines += ["", "| status | episodes | fraction |", "|---|---|---|"]
        mix = self.status_mix
        lines += [f"| {s} | {self.status_counts.get(s, 0)} | {mix[s]:.3f} |" for s in mix]
        if self.status_reason_counts:
            reasons = ", ".join(f"{r}: {n}" for r, n in sorted(self.status_reason_counts.items()))
            lines += ["", f"Status reasons: {reasons}."]
        lines += [
            "",
            "| episode statistic | mean |",
            "|---|---|",
            f"| turns | {format_value(self.turns_mean)} |",
            f"| tool calls | {format_value(self.tool_calls_per_episode)} |",
            f"| tool errors | {format_value(self.tool_errors_per_episode)} |",
            f"| response tokens | {format_value(self.response_len_mean)} |",
            "",
            "Reward and pass@k CIs: Student t over per-task means (Wilson when every task scores "
            "0 or 1). Pass rate: Wilson over scored episodes. maj@k: Wilson over tasks. "
            "ERROR/ABORTED episodes are excluded, not scored 0.",
        ]
        return "\n".join(lines) + "\n"

    def write(self, out_dir: str | Path) -> None:
        """report.json, report.md and report.png in `out_dir`, each replaced atomically."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out / "report.json", json.dumps(self.to_dict(), indent=2) + "\n")
        write_text_atomic(out / "report.md", self.to_markdown())
        plot_report(self, out / "report.png")


# ---------------------------------------------------------------- building


def build_report(
    groups: Sequence[Group],
    *,
    k: int,
    temperature: float,
    meta: dict[str, Any] | None = None,
) -> EvalReport:
    """One report from the k-episode groups of each task."""
    episodes = [t for g in groups for t in g]
    scored_groups = [[t for t in g if stats.is_scored(t)] for g in groups]
    scored = [t for g in scored_groups for t in g]
    task_rewards = [math.fsum(t.reward for t in g) / len(g) for g in scored_groups if g]
    num_correct = sum(stats.is_correct(t) for t in scored)
    return EvalReport(
        k=k,
        temperature=temperature,
        num_tasks=len(groups),
        num_episodes=len(episodes),
        num_scored_episodes=len(scored),
        reward=stats.task_mean_ci(task_rewards),
        reward_std=stats.std([t.reward for t in scored]),
        pass_rate=stats.wilson_ci(num_correct, len(scored)),
        pass_at_k={j: _pass_at(scored_groups, j) for j in stats.pass_at_k_levels(k)},
        maj_at_k=_maj(scored_groups),
        status_counts=dict(Counter(EpisodeStatus(t.status).value for t in episodes)),
        status_reason_counts=dict(Counter(StatusReason(t.status_reason).value for t in episodes)),
        turns_mean=_mean([t.num_turns for t in scored]),
        tool_calls_per_episode=_mean([stats.num_tool_calls(t) for t in scored]),
        tool_calls=stats.task_mean_ci(
            [_mean([stats.num_tool_calls(t) for t in g]) for g in scored_groups if g]
        ),
        tool_errors_per_episode=_mean([stats.num_tool_errors(t) for t in scored]),
        response_len_mean=_mean([t.response_len for t in scored]),
        components=_components(scored_groups),
        meta=dict(meta or {}),
    )


def _components(scored_groups: list[Group]) -> dict[str, Interval]:
    """Each reward component's mean over per-task means, in the order the env reports them."""
    per_task = [[stats.reward_components(t) for t in g] for g in scored_groups if g]
    names = list(dict.fromkeys(name for task in per_task for c in task for name in c))
    out = {}
    for name in names:
        means = [_mean([c[name] for c in task if name in c]) for task in per_task]
        out[name] = stats.task_mean_ci([m for m in means if not math.isnan(m)])
    return out


def _pass_at(scored_groups: list[Group], k: int) -> Interval:
    """Mean unbiased pass@k over tasks with at least k scored episodes."""
    values = [
        stats.pass_at_k(len(g), sum(stats.is_correct(t) for t in g), k)
        for g in scored_groups
        if len(g) >= k
    ]
    return stats.task_mean_ci(values)


def _maj(scored_groups: list[Group]) -> Interval:
    votes = [
        stats.maj_at_k([stats.extract_answer(t) for t in g], [stats.is_correct(t) for t in g])
        for g in scored_groups
        if g
    ]
    return stats.wilson_ci(sum(votes), len(votes))


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan


def format_value(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:.3f}"


def write_text_atomic(path: Path, text: str) -> None:
    """`text` into `path` through a synced temp file, so a crash leaves the old file whole."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------- report.png (figure)


def report_bars(report: EvalReport) -> list[tuple[str, Interval]]:
    """(label, interval) of each bar of report.png: reward clipped to the env's reward_range,
    the rest to [0, 1]."""
    env = str(report.meta.get("env", ""))
    bars = []
    for name, iv in report.rows(components=False):
        bounds = plots.env_reward_range(env) if name == "reward" else plots.UNIT_RANGE
        low, high = plots.clip([iv.low, iv.high], bounds)
        label = plots.pass_label(env) if name == "pass rate" else name
        bars.append((label, Interval(iv.mean, low, high, iv.n)))
    return bars


def report_title(report: EvalReport) -> str:
    """Which run this is (env, split, model, step, as the report knows them) and its size."""
    meta = report.meta
    known = [k for k in ("env", "split", "model", "step") if meta.get(k) not in (None, "")]
    named = [str(meta[k]) if k in ("env", "model") else f"{k} {meta[k]}" for k in known]
    return " · ".join([*named, f"{report.num_tasks} tasks × {report.k}"])


def report_figure(report: EvalReport) -> Figure:
    """Bars for mean reward, pass rate, pass@k and maj@k with their 95% CI error bars (none
    where nothing was scored, never a bar of 0), and the status mix when episodes failed."""
    mix = report.status_mix
    bars = report_bars(report)
    widths = [1.2 * len(bars) + 2.0] + ([2.5] if plots.failed([mix]) else [])
    fig, axes = plots.pyplot().subplots(
        1, len(widths), figsize=(sum(widths), 3.8), squeeze=False, width_ratios=widths
    )
    ax = axes[0][0]
    names = [f"{name}\n{format_value(iv.mean)}" for name, iv in bars]
    means = [iv.mean for _, iv in bars]
    errors = [[_gap(iv.mean, iv.low) for _, iv in bars], [_gap(iv.high, iv.mean) for _, iv in bars]]
    ax.bar(names, means, yerr=errors, capsize=4, color=plots.COLOR)
    ax.set_xlim(-0.5, len(bars) - 0.5)  # every name shows, even over no bar at all
    if all(math.isnan(m) for m in means):
        ax.set_ylim(0.0, 1.0)
        ax.text(len(bars) / 2 - 0.5, 0.5, "no episode scored: see the status mix", ha="center")
    ax.set_ylabel("value (95% CI)")
    ax.set_title("held-out numbers", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    if len(widths) == 2:
        plots.draw_status_mix(axes[0][1], [0.0], [mix])
        axes[0][1].set_xticks([])
    fig.suptitle(report_title(report), fontsize=11)
    fig.tight_layout()
    return fig


def plot_report(report: EvalReport, path: str | Path) -> Figure:
    """report.png: `report_figure`, returned once written."""
    return plots.save_figure(report_figure(report), path)


def _gap(high: float, low: float) -> float:
    return 0.0 if math.isnan(high) or math.isnan(low) else max(0.0, high - low)
