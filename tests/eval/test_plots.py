"""eval_history.png as a figure: labels for its env, integer steps, a title naming the run,
intervals clipped to what the numbers can be, and the status mix when episodes failed (never a
row of zeros)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from agentrl.eval.plots import eval_history_figure, pass_label, plot_eval_history


def _entry(step: int, **values: float) -> dict[str, Any]:
    """A summary() entry of the history: reward and pass rate with intervals, all completed."""
    entry = {
        "step": step,
        "reward_mean": 0.5,
        "reward_ci_low": 0.3,
        "reward_ci_high": 0.7,
        "pass_rate": 0.5,
        "pass_rate_ci_low": 0.3,
        "pass_rate_ci_high": 0.7,
        "tool_calls_mean": 1.0,
        "status/completed": 1.0,
        "status/truncated": 0.0,
        "status/error": 0.0,
        "status/aborted": 0.0,
    }
    return {**entry, **values}


def _band_ys(ax: Any) -> list[float]:
    """The y values of the CI band (fill_between) of a curve panel."""
    (band,) = ax.collections
    return [float(y) for path in band.get_paths() for y in path.vertices[:, 1]]


def test_pass_rate_is_labelled_by_the_envs_own_metric() -> None:
    assert pass_label("search_r1") == "EM (pass rate)"
    assert pass_label("calculator") == "exact answer (pass rate)"
    assert pass_label("my_env:CapitalsEnv") == pass_label("") == "pass rate"
    fig = eval_history_figure([_entry(0)], env="calculator")
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["held-out reward", "exact answer (pass rate)", "tool calls per episode"]
    assert "search_r1" not in " ".join(titles)


def test_history_steps_are_integers_and_the_title_names_the_run(tmp_path) -> None:
    run_dir = tmp_path / "calc-lr2e-5"
    run_dir.mkdir()
    history = [_entry(0), _entry(1), _entry(3)]
    fig = plot_eval_history(history, run_dir / "eval_history.png", env="calculator")
    assert (run_dir / "eval_history.png").stat().st_size > 0
    assert fig.get_suptitle() == "calc-lr2e-5 · calculator"
    for ax in fig.axes:
        ticks = list(ax.get_xticks())
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
        assert ax.get_xlabel() == "train step"


def test_history_intervals_are_clipped_to_the_reward_range() -> None:
    # n=2 tasks: a Student t interval of [-5.17, 6.27] for a reward that lies in [0, 1]
    wide = {"reward_ci_low": -5.17, "reward_ci_high": 6.27, "tool_calls_ci_low": -0.4}
    history = [_entry(0, **wide, tool_calls_ci_high=2.4), _entry(1)]
    reward_ax, pass_ax, tools_ax = eval_history_figure(history, env="calculator").axes
    ys = _band_ys(reward_ax)
    assert min(ys) == 0.0 and max(ys) == 1.0
    assert reward_ax.get_ylim() == pytest.approx((-0.05, 1.05))
    assert pass_ax.get_ylim() == pytest.approx((-0.05, 1.05))
    # an env that declares no range: the interval is drawn as computed
    unbounded = eval_history_figure(history, env="").axes[0]
    assert min(_band_ys(unbounded)) == pytest.approx(-5.17)
    assert min(_band_ys(tools_ax)) == 0.0  # no fewer than 0 tool calls


def test_failed_episodes_draw_the_status_mix_and_no_zeros() -> None:
    nan = math.nan
    nothing_scored = {key: nan for key in _entry(0) if not key.startswith(("step", "status/"))}
    all_aborted = _entry(1, **nothing_scored, **{"status/completed": 0.0, "status/aborted": 1.0})
    fig = eval_history_figure([_entry(0), all_aborted], env="calculator")
    assert len(fig.axes) == 4
    reward_ax, status_ax = fig.axes[0], fig.axes[3]
    assert status_ax.get_title() == "episode status mix"
    shares = {c.get_label(): [p.get_height() for p in c] for c in status_ax.containers}
    assert shares["aborted"] == [0.0, 1.0] and shares["completed"] == [1.0, 0.0]
    (line,) = reward_ax.get_lines()
    assert line.get_ydata()[0] == 0.5 and math.isnan(line.get_ydata()[1])  # not a 0
    assert len(eval_history_figure([_entry(0)], env="calculator").axes) == 3
