"""pass@k, maj@k, t and Wilson intervals against hand-computed values."""

from __future__ import annotations

import math

import pytest

from agentrl.eval import stats
from agentrl.types import EpisodeStatus


@pytest.mark.parametrize(
    ("k", "expected"),
    [
        (1, 2 / 5),  # c/n
        (2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (3, 1 - 1 / 10),  # 1 - C(3,3)/C(5,3)
        (4, 1.0),  # fewer than k wrong samples: some k-subset always has a correct one
        (5, 1.0),
    ],
)
def test_pass_at_k_n5_c2(k: int, expected: float) -> None:
    assert stats.pass_at_k(5, 2, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_pass_at_k_all_wrong_or_all_right(k: int) -> None:
    assert stats.pass_at_k(5, 0, k) == 0.0
    assert stats.pass_at_k(5, 5, k) == 1.0


def test_pass_at_k_matches_binomial_form_for_large_n() -> None:
    for n, c, k in [(50, 7, 10), (200, 1, 100), (100, 30, 1), (64, 63, 2)]:
        exact = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert stats.pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-9, abs=1e-12)


def test_pass_at_k_rejects_k_above_n_and_bad_counts() -> None:
    with pytest.raises(ValueError, match="k=6 must be between 1 and n=5"):
        stats.pass_at_k(5, 2, 6)
    with pytest.raises(ValueError, match="c=7"):
        stats.pass_at_k(5, 7, 1)


def test_pass_at_k_levels() -> None:
    assert stats.pass_at_k_levels(1) == [1]
    assert stats.pass_at_k_levels(4) == [1, 2, 4]
    assert stats.pass_at_k_levels(5) == [1, 2, 4, 5]
    assert stats.pass_at_k_levels(8) == [1, 2, 4, 8]


def test_maj_at_k_votes_the_most_frequent_answer() -> None:
    assert stats.maj_at_k(["4", "5", "4"], [True, False, True]) is True
    assert stats.maj_at_k(["5", "4", "5"], [False, True, False]) is False


def test_maj_at_k_tie_break_does_not_depend_on_order() -> None:
    # "a" and "b" tie; the lexicographically smallest wins whatever order episodes finished in.
    assert stats.majority_answer(["b", "a"]) == "a"
    assert stats.majority_answer(["a", "b"]) == "a"
    assert stats.maj_at_k(["b", "a"], [True, False]) is False
    assert stats.maj_at_k(["a", "b"], [False, True]) is False


def test_maj_at_k_length_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="2 answers but 1 grades"):
        stats.maj_at_k(["a", "b"], [True])


def test_extract_answer_prefers_info_then_last_turn_text(make_traj) -> None:
    # the calculator env: gold under "answer", the model's parsed answer under "predicted"
    assert stats.extract_answer(make_traj(info={"predicted": 41.0, "answer": 42.0})) == "41.0"
    assert stats.extract_answer(make_traj(info={"predicted": None, "answer": 42.0}, text="x")) == ""
    assert stats.extract_answer(make_traj(info={"answer": " 42 "}, text="the answer is 41")) == "42"
    assert (
        stats.extract_answer(make_traj(text="  the\n answer  is 41 ", num_turns=2))
        == "the answer is 41"
    )


def test_is_correct_uses_info_correct_else_positive_reward(make_traj) -> None:
    assert stats.is_correct(make_traj(reward=1.0))
    assert not stats.is_correct(make_traj(reward=0.0))
    # partial credit that the env grades wrong
    assert not stats.is_correct(make_traj(reward=0.2, info={"correct": False}))
    assert stats.is_correct(make_traj(reward=0.0, info={"correct": True}))


def test_is_scored_excludes_infrastructure_outcomes(make_traj) -> None:
    assert stats.is_scored(make_traj(status=EpisodeStatus.COMPLETED))
    assert stats.is_scored(make_traj(status=EpisodeStatus.TRUNCATED))
    assert not stats.is_scored(make_traj(status=EpisodeStatus.ERROR))
    assert not stats.is_scored(make_traj(status=EpisodeStatus.ABORTED))
    # a reward that is no finite number, read from an old file, would make every mean NaN
    assert not stats.is_scored(make_traj(reward=math.nan))
    assert not stats.is_scored(make_traj(reward=-math.inf, status=EpisodeStatus.TRUNCATED))


@pytest.mark.parametrize(
    ("successes", "n", "low", "high"),
    [  # reference: scipy.stats.binomtest(x, n).proportion_ci(method="wilson")
        (5, 10, 0.236593090512564, 0.7634069094874361),
        (0, 10, 0.0, 0.27753279986288926),
        (10, 10, 0.7224672001371109, 1.0),
        (8, 10, 0.4901624715366418, 0.9433178485456248),
        (1, 20, 0.008881448800795402, 0.23613119344674205),
    ],
)
def test_wilson_ci_known_values(successes: int, n: int, low: float, high: float) -> None:
    iv = stats.wilson_ci(successes, n)
    assert iv.mean == successes / n
    assert iv.low == pytest.approx(low, abs=1e-9)
    assert iv.high == pytest.approx(high, abs=1e-9)


def test_wilson_ci_shrinks_with_n() -> None:
    widths = [
        stats.wilson_ci(n // 2, n).high - stats.wilson_ci(n // 2, n).low for n in (10, 100, 1000)
    ]
    assert widths[0] > widths[1] > widths[2]
    assert math.isnan(stats.wilson_ci(0, 0).mean)


@pytest.mark.parametrize(
    ("df", "value"),  # two-sided 95% Student t critical values (standard tables)
    [
        (1, 12.706205),
        (2, 4.302653),
        (3, 3.182446),
        (4, 2.776445),
        (10, 2.228139),
        (30, 2.042272),
        (5000, 1.959964),
    ],
)
def test_t_critical_known_values(df: int, value: float) -> None:
    assert stats.t_critical(df) == pytest.approx(value, abs=1e-5)


def test_mean_ci_hand_computed() -> None:
    iv = stats.mean_ci([1.0, 0.0, 1.0, 1.0])  # mean 0.75, sample std 0.5, t(3) = 3.182446
    half = 3.182446305 * 0.5 / 2
    assert (iv.mean, iv.n) == (0.75, 4)
    assert iv.low == pytest.approx(0.75 - half, abs=1e-8)
    assert iv.high == pytest.approx(0.75 + half, abs=1e-8)


def test_task_mean_ci_uses_wilson_for_all_binary_values() -> None:
    assert stats.task_mean_ci([0.0, 0.0, 0.0]) == stats.wilson_ci(0, 3)  # t would give [0, 0]
    assert stats.task_mean_ci([1.0, 0.0, 1.0]) == stats.wilson_ci(2, 3)
    assert stats.task_mean_ci([0.5, 1.0, 0.0]) == stats.mean_ci([0.5, 1.0, 0.0])


def test_mean_ci_shrinks_with_n_and_degenerates_gracefully() -> None:
    widths = []
    for n in (4, 40, 400):
        iv = stats.mean_ci([float(i % 2) for i in range(n)])
        widths.append(iv.high - iv.low)
    assert widths[0] > widths[1] > widths[2]
    assert stats.mean_ci([0.3]) == stats.Interval(0.3, 0.3, 0.3, 1)
    assert math.isnan(stats.mean_ci([]).mean)
