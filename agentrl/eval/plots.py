"""What every eval figure shares (the env's pass-rate label and reward range, intervals clipped
to what a number can be, the status mix drawn when episodes failed: failures are statuses, not
zeros) and eval_history.png, the learning curve against train step. report.py draws report.png."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.eval import stats
from agentrl.types import EpisodeStatus

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


PASS_METRICS = {"search_r1": "EM", "calculator": "exact answer", "code_sandbox": "tests pass"}
"""What an env's pass rate (`info["correct"]`) counts, by env id: its axis label."""
UNIT_RANGE = (0.0, 1.0)
"""Rates, pass@k and maj@k lie here."""
FAILED = (EpisodeStatus.TRUNCATED, EpisodeStatus.ERROR, EpisodeStatus.ABORTED)
STATUS_COLORS = {
    EpisodeStatus.COMPLETED: "#55A868",
    EpisodeStatus.TRUNCATED: "#DD8452",
    EpisodeStatus.ERROR: "#C44E52",
    EpisodeStatus.ABORTED: "#8C8C8C",
}
COLOR = "#4C72B0"


def pass_label(env: str) -> str:
    """The pass-rate label of `env`: "EM (pass rate)" for search_r1, "pass rate" by default."""
    metric = PASS_METRICS.get(env)
    return f"{metric} (pass rate)" if metric else "pass rate"


def env_reward_range(env: str) -> tuple[float, float]:
    """The env's declared `reward_range`; unbounded for an env not loadable here (or served
    over HTTP: its class is not asked over the network for a plot)."""
    unbounded = (-math.inf, math.inf)
    if not env or env.startswith(("http://", "https://")):
        return unbounded
    from agentrl.envs import registry

    try:
        low, high = registry.spec(env).load_class().reward_range
    except (LookupError, ImportError, TypeError, ValueError):
        return unbounded
    return float(low), float(high)


def clip(values: Sequence[float], bounds: tuple[float, float]) -> list[float]:
    """Each value within `bounds`; NaN (nothing measured) stays NaN."""
    low, high = bounds
    return [v if math.isnan(v) else min(max(v, low), high) for v in values]


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers or CI
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Figure, path: str | Path) -> Figure:
    """`fig` written to `path` and closed (its objects stay readable)."""
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
    return fig


def _integer_steps(ax: Axes) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _limit_y(ax: Axes, bounds: tuple[float, float]) -> None:
    """A finite range is the axis, with a margin, so a clipped band shows where it stops."""
    low, high = bounds
    if math.isfinite(low) and math.isfinite(high) and high > low:
        margin = 0.05 * (high - low)
        ax.set_ylim(low - margin, high + margin)


# ---------------------------------------------------------------- status mix


def failed(mixes: Sequence[dict[str, float]]) -> bool:
    """Whether any episode of these status mixes failed (truncated, error, aborted)."""
    return any(mix.get(s.value, 0.0) > 0 for mix in mixes for s in FAILED)


def draw_status_mix(ax: Axes, xs: Sequence[float], mixes: Sequence[dict[str, float]]) -> None:
    """Stacked bars of each status's share of the episodes at each x."""
    gaps = [b - a for a, b in zip(xs, xs[1:], strict=False) if b > a]
    width = 0.6 * min(gaps, default=1.0)
    bottom = [0.0] * len(xs)
    for status, color in STATUS_COLORS.items():
        share = [mix.get(status.value, 0.0) for mix in mixes]
        ax.bar(xs, share, width, bottom=bottom, color=color, label=status.value)
        bottom = [b + s for b, s in zip(bottom, share, strict=True)]
    ax.set_ylim(0.0, 1.05)
    ax.set_title("episode status mix", fontsize=10)
    ax.set_ylabel("fraction of episodes")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)  # beside, not on, the bars


# ---------------------------------------------------------------- eval_history.png


def history_curves(env: str) -> list[tuple[str, str, tuple[float, float]]]:
    """(summary name, panel title, the range its band is clipped to) of each learning curve."""
    return [
        ("reward", "held-out reward", env_reward_range(env)),
        ("pass_rate", pass_label(env), UNIT_RANGE),
        ("tool_calls", "tool calls per episode", (0.0, math.inf)),
    ]


def eval_history_figure(history: list[dict[str, Any]], *, env: str = "", title: str = "") -> Figure:
    """The learning curve: held-out reward, pass rate (labelled for `env`) and tool calls per
    episode against integer train steps, each with its 95% CI band clipped to what it can be;
    a fourth panel with the status mix when any eval had failed episodes.

    Each entry is `{"step": int, **report.summary()}` (flat `reward_mean`, `reward_ci_low`,
    `pass_rate_ci_low`, `status/error`...) or `{"step": int, **report.to_dict()}`.
    """
    if not history:
        raise ValueError("plot_eval_history needs at least one evaluation in history")
    rows = sorted(history, key=lambda h: h["step"])
    steps = [int(h["step"]) for h in rows]
    curves = history_curves(env)
    mixes = [_status_mix(h) for h in rows]
    num_panels = len(curves) + failed(mixes)
    fig, axes = pyplot().subplots(1, num_panels, figsize=(4.2 * num_panels, 3.6), squeeze=False)
    for ax, (name, label, bounds) in zip(axes[0], curves, strict=False):
        _draw_curve(ax, steps, [_band(h, name) for h in rows], label, bounds)
    if failed(mixes):
        draw_status_mix(axes[0][-1], steps, mixes)
    for ax in axes[0]:
        ax.set_xlabel("train step")
        _integer_steps(ax)
    axes[0][0].legend(loc="best", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def _draw_curve(
    ax: Axes,
    steps: list[int],
    bands: list[tuple[float, float, float]],
    label: str,
    bounds: tuple[float, float],
) -> None:
    """One curve's means (NaN, nothing scored, leaves a gap) and its band within `bounds`."""
    mean, low, high = zip(*bands, strict=True)
    ax.plot(steps, mean, marker="o", color=COLOR, label=label)
    ax.fill_between(
        steps, clip(low, bounds), clip(high, bounds), color=COLOR, alpha=0.2, label="95% CI"
    )
    _limit_y(ax, bounds)
    ax.set_title(label, fontsize=10)
    ax.grid(alpha=0.3)


def plot_eval_history(
    history: list[dict[str, Any]], path: str | Path, *, env: str = "", title: str = ""
) -> Figure:
    """eval_history.png: `eval_history_figure`, returned once written; titled by `title`, else
    by the directory it is written into (a run's) and the env."""
    env = env or _meta(history, "env")
    title = title or " · ".join(x for x in (Path(path).resolve().parent.name, env) if x)
    return save_figure(eval_history_figure(history, env=env, title=title), path)


def _meta(history: list[dict[str, Any]], key: str) -> str:
    """`key` of the latest entry's meta (full reports carry one; summaries do not)."""
    meta = max(history, key=lambda h: h["step"]).get("meta") if history else None
    return str(meta.get(key, "")) if isinstance(meta, dict) else ""


def _status_mix(entry: dict[str, Any]) -> dict[str, float]:
    """An entry's status fractions: a full report's `status_mix`, or a summary's `status/*`."""
    if isinstance(entry.get("status_mix"), dict):
        return {k: float(v) for k, v in entry["status_mix"].items()}
    prefix = "status/"
    return {k[len(prefix) :]: float(v) for k, v in entry.items() if k.startswith(prefix)}


_MEAN_KEYS = {
    "reward": ("reward_mean",),
    "pass_rate": ("pass_rate",),
    "tool_calls": ("tool_calls_mean", "tool_calls_per_episode"),  # older histories: the latter
}
"""The keys a `summary()` entry holds each curve's mean under, first found wins."""


def _band(entry: dict[str, Any], name: str) -> tuple[float, float, float]:
    """(mean, low, high) of one curve; NaN where the entry lacks it (old histories: no band)."""
    if isinstance(entry.get(name), dict):  # a full report.to_dict()
        values = (entry[name]["mean"], entry[name]["low"], entry[name]["high"])
    else:
        mean = next((entry[key] for key in _MEAN_KEYS[name] if key in entry), None)
        if name == "reward" and mean is None:
            raise ValueError(
                f"eval history entry at step {entry.get('step')} has no reward_mean or reward "
                "dict; append {'step': step, **report.summary()}"
            )
        values = (mean, entry.get(f"{name}_ci_low"), entry.get(f"{name}_ci_high"))
        if name == "pass_rate" and values[1] is None and entry.get("num_episodes"):
            # histories written before the interval was logged: Wilson from the count
            n = int(entry["num_episodes"])
            iv = stats.wilson_ci(round(float(entry["pass_rate"]) * n), n)
            values = (iv.mean, iv.low, iv.high)
    return tuple(math.nan if v is None else float(v) for v in values)  # type: ignore[return-value]
