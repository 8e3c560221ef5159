"""EvalReport numbers from constructed groups, the JSON/Markdown/PNG files it writes, and
report.png as a figure: the env's labels, clipped intervals, the status mix of failures."""

from __future__ import annotations

import json
import math

import pytest
from PIL import Image

from agentrl.eval.report import build_report, plot_eval_history, plot_report, report_bars
from agentrl.types import EpisodeStatus

ERROR, TRUNC, ABORTED = EpisodeStatus.ERROR, EpisodeStatus.TRUNCATED, EpisodeStatus.ABORTED


@pytest.fixture
def groups(make_traj):
    return [
        # task 0: 2 of 3 correct; majority answer "4" is correct
        [
            make_traj(1.0, text="4"),
            make_traj(0.0, text="5"),
            make_traj(1.0, text="4", num_tool_calls=2),
        ],
        # task 1: one ERROR episode (reward 0 stored) must not drag the mean down
        [make_traj(1.0, text="7"), make_traj(0.0, ERROR), make_traj(1.0, text="7", num_turns=3)],
        # task 2: all wrong, one truncated; majority "1" is wrong
        [
            make_traj(0.0, text="1"),
            make_traj(0.0, text="1"),
            make_traj(0.0, TRUNC, text="2", num_tool_errors=1),
        ],
    ]


def test_build_report_excludes_error_from_reward_and_counts_it_in_status_mix(groups) -> None:
    report = build_report(groups, k=3, temperature=1.0)
    assert report.num_episodes == 9 and report.num_scored_episodes == 8
    # per-task means over scored episodes: 2/3, 1 (not 2/3), 0
    assert report.reward.mean == pytest.approx((2 / 3 + 1.0 + 0.0) / 3)
    assert report.reward.n == 3
    assert report.pass_rate.mean == pytest.approx(4 / 8)
    assert report.status_counts == {"completed": 7, "error": 1, "truncated": 1}
    assert report.status_mix["error"] == pytest.approx(1 / 9)
    assert report.status_reason_counts["engine"] == 1


def test_build_report_pass_and_maj_at_k(groups) -> None:
    report = build_report(groups, k=3, temperature=1.0)
    assert sorted(report.pass_at_k) == [1, 2, 3]
    # pass@1 per task: 2/3, 2/2, 0/3
    assert report.pass_at_k[1].mean == pytest.approx((2 / 3 + 1.0 + 0.0) / 3)
    # pass@3 needs 3 scored episodes: task 1 (2 scored) is left out
    assert report.pass_at_k[3].n == 2
    assert report.pass_at_k[3].mean == pytest.approx(0.5)
    assert (report.maj_at_k.mean, report.maj_at_k.n) == (pytest.approx(2 / 3), 3)


def test_build_report_episode_statistics(groups) -> None:
    report = build_report(groups, k=3, temperature=1.0)
    assert report.turns_mean == pytest.approx((7 + 3) / 8)
    assert report.tool_calls_per_episode == pytest.approx(2 / 8)
    assert report.tool_errors_per_episode == pytest.approx(1 / 8)


def test_report_files_round_trip_and_png_is_valid(groups, tmp_path) -> None:
    report = build_report(groups, k=3, temperature=0.7, meta={"env": "calculator", "step": 3})
    report.write(tmp_path)
    loaded = json.loads((tmp_path / "report.json").read_text())
    assert loaded == json.loads(json.dumps(report.to_dict()))
    assert loaded["pass_at_k"]["3"] == report.pass_at_k[3].to_dict()
    md = (tmp_path / "report.md").read_text()
    assert "| pass@3 |" in md and "| maj@3 |" in md and "calculator" in md
    with Image.open(tmp_path / "report.png") as img:
        img.verify()
    with Image.open(tmp_path / "report.png") as img:
        assert img.format == "PNG" and img.size[0] > 100 and img.size[1] > 100


def test_report_with_only_errors_writes_null_not_nan(make_traj, tmp_path) -> None:
    report = build_report([[make_traj(0.0, ERROR)]], k=1, temperature=0.0)
    assert math.isnan(report.reward.mean)
    report.write(tmp_path)
    text = (tmp_path / "report.json").read_text()
    assert "NaN" not in text
    assert json.loads(text)["reward"]["mean"] is None
    assert "n/a" in (tmp_path / "report.md").read_text()


def test_summary_is_flat_floats(groups) -> None:
    summary = build_report(groups, k=3, temperature=1.0).summary(prefix="eval/")
    assert summary["eval/pass@3"] == pytest.approx(0.5)
    assert summary["eval/status/error"] == pytest.approx(1 / 9)
    assert all(isinstance(v, float) for v in summary.values())


def test_plot_eval_history_accepts_summaries_and_full_reports(groups, tmp_path) -> None:
    report = build_report(groups, k=3, temperature=1.0)
    history = [{"step": 10, **report.summary()}, {"step": 0, **report.to_dict()}]
    plot_eval_history(history, tmp_path / "history.png")
    with Image.open(tmp_path / "history.png") as img:
        img.verify()
    with pytest.raises(ValueError, match="at least one evaluation"):
        plot_eval_history([], tmp_path / "empty.png")
    with pytest.raises(ValueError, match="step 3 has no reward_mean"):
        plot_eval_history([{"step": 3, "pass_rate": 0.5}], tmp_path / "bad.png")


def test_tool_calls_and_pass_rate_have_intervals_for_the_learning_curve(groups) -> None:
    report = build_report(groups, k=3, temperature=1.0)
    # tool calls per task (scored episodes): (0 + 0 + 2) / 3, 0 / 2, 0 / 3 -> mean 2/9 over tasks
    assert report.tool_calls is not None
    assert report.tool_calls.mean == pytest.approx(2 / 9) and report.tool_calls.n == 3
    summary = report.summary()
    assert summary["tool_calls_ci_low"] <= 2 / 9 <= summary["tool_calls_ci_high"]
    assert summary["pass_rate_ci_low"] == pytest.approx(report.pass_rate.low)
    assert json.loads(json.dumps(report.to_dict()))["tool_calls"] == report.tool_calls.to_dict()


def test_learning_curve_bands_from_summaries_full_reports_and_old_histories(groups) -> None:
    from agentrl.eval.plots import _band

    report = build_report(groups, k=3, temperature=1.0)
    flat, full = report.summary(), report.to_dict()
    for entry in (flat, full):
        assert _band(entry, "pass_rate") == pytest.approx(
            (report.pass_rate.mean, report.pass_rate.low, report.pass_rate.high)
        )
        assert _band(entry, "tool_calls")[0] == pytest.approx(2 / 9)
    # a history written before the intervals were logged: Wilson from the count, no tool band
    old = {"step": 0, "reward_mean": 0.5, "pass_rate": 0.25, "num_episodes": 8.0,
           "tool_calls_per_episode": 0.5}  # fmt: skip
    mean, low, high = _band(old, "pass_rate")
    assert mean == pytest.approx(0.25) and 0.0 < low < 0.25 < high < 1.0
    assert _band(old, "tool_calls")[0] == 0.5 and math.isnan(_band(old, "tool_calls")[1])


def test_report_png_clips_labels_and_shows_an_all_aborted_eval(make_traj, tmp_path) -> None:
    meta = {"env": "calculator", "split": "test", "model": "smollm2", "step": 6}
    # per-task means 0.1 and 0.9 over n=2 tasks: t(1) = 12.7 makes the interval [-4.58, 5.58]
    wide = [[make_traj(1.0), *[make_traj(0.0)] * 9], [*[make_traj(1.0)] * 9, make_traj(0.0)]]
    report = build_report(wide, k=10, temperature=1.0, meta=meta)
    assert report.reward.low < -4 and report.reward.high > 5
    bars = dict(report_bars(report))
    assert (bars["reward"].low, bars["reward"].high) == (0.0, 1.0)
    assert "exact answer (pass rate)" in bars and "pass rate" not in bars
    fig = plot_report(report, tmp_path / "report.png")
    assert fig.get_suptitle() == "calculator · split test · smollm2 · step 6 · 2 tasks × 10"
    assert len(fig.axes) == 1  # every episode completed: no status panel

    aborted = build_report([[make_traj(0.0, ABORTED)] * 2], k=2, temperature=1.0, meta=meta)
    fig = plot_report(aborted, tmp_path / "aborted.png")
    bars_ax, status_ax = fig.axes
    assert all(math.isnan(p.get_height()) for p in bars_ax.patches)  # no bar of 0
    labels = [label.get_text() for label in bars_ax.get_xticklabels()]
    assert len(labels) == len(report_bars(aborted)) and all("n/a" in label for label in labels)
    assert "no episode scored: see the status mix" in [t.get_text() for t in bars_ax.texts]
    shares = {c.get_label(): [p.get_height() for p in c] for c in status_ax.containers}
    assert shares["aborted"] == [1.0] and shares["completed"] == [0.0]
