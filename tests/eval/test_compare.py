"""Paired before/after comparison: per-task differences, hand-computed, and the reward
components an env reports beside its reward."""

from __future__ import annotations

import pytest

from agentrl.eval.compare import compare, compare_dirs, format_diff
from agentrl.eval.report import build_report
from agentrl.types import EpisodeStatus, write_jsonl


def _parts(em: float, fmt: float, is_answered: bool) -> dict:
    parts = {"answer": "x", "em": em, "format": fmt, "is_answered": is_answered}
    return {"reward_components": parts, "correct": bool(em)}


def test_paired_differences_are_per_task_and_skip_unscored_episodes(make_traj) -> None:
    before = [
        [make_traj(0.0, task_id="a"), make_traj(0.2, task_id="a")],  # task mean 0.1
        [make_traj(0.0, task_id="b"), make_traj(0.0, task_id="b")],  # 0.0
        [make_traj(0.1, task_id="c"), make_traj(0.1, task_id="c")],  # 0.1
    ]
    after = [
        [make_traj(0.2, task_id="a"), make_traj(0.2, task_id="a")],  # 0.2: +0.1
        # the ERROR episode's stored 0 is no score: the task mean is 0.3, +0.3
        [make_traj(0.3, task_id="b"), make_traj(0.0, EpisodeStatus.ERROR, task_id="b")],
        [make_traj(0.1, task_id="c"), make_traj(0.3, task_id="c")],  # 0.2: +0.1
        [make_traj(1.0, task_id="d")],  # not evaluated before: not paired
    ]
    diff = compare(before, after)["reward"]
    # differences 0.1, 0.3, 0.1: mean 1/6, s = 0.11547, t(2) = 4.3027 -> half width 0.28685
    assert diff.n == 3
    assert diff.mean == pytest.approx(1 / 6)
    assert diff.low == pytest.approx(1 / 6 - 0.28685, abs=1e-4)
    assert diff.high == pytest.approx(1 / 6 + 0.28685, abs=1e-4)
    assert format_diff("reward", diff) == "reward +0.167 [-0.120, +0.454] (n=3 tasks)"


def test_components_are_compared_and_reported(make_traj, tmp_path) -> None:
    before = [[make_traj(0.0, task_id=t, info=_parts(0.0, 0.0, False))] for t in "abcd"]
    after = [[make_traj(0.1, task_id=t, info=_parts(0.0, 0.1, True))] for t in "abc"] + [
        [make_traj(1.0, task_id="d", info={**_parts(1.0, 1.0, True), "correct": True})]
    ]

    diffs = compare(before, after)

    assert diffs["is_answered"].mean == pytest.approx(1.0)
    assert (diffs["is_answered"].low, diffs["is_answered"].high) == (1.0, 1.0)
    assert diffs["em"].mean == pytest.approx(0.25)
    assert diffs["pass_rate"].mean == pytest.approx(0.25)  # `correct`, not reward > 0
    assert "answer" not in diffs  # text is no metric
    report = build_report(after, k=1, temperature=0.0)
    assert list(report.components) == ["em", "format", "is_answered"]
    assert report.components["format"].mean == pytest.approx((0.1 * 3 + 1.0) / 4)
    assert report.summary()["is_answered_mean"] == 1.0
    assert "| is_answered (component) | 1.000 |" in report.to_markdown()

    for name, groups in (("before", before), ("after", after)):
        (tmp_path / name).mkdir()
        write_jsonl(
            str(tmp_path / name / "eval_trajectories.jsonl"), [t for g in groups for t in g]
        )
    assert compare_dirs(tmp_path / "before", tmp_path / "after")["em"].mean == pytest.approx(0.25)
    with pytest.raises(FileNotFoundError, match="RUN/eval/step_000000"):
        compare_dirs(tmp_path / "nowhere", tmp_path / "after")
