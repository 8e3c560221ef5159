"""Pure evaluation statistics: unbiased pass@k, maj@k, Student-t and Wilson intervals,
and what counts as a correct, scored episode and its answer."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

from agentrl.types import EpisodeStatus, Trajectory


@dataclass(frozen=True)
class Interval:
    """A point estimate with a two-sided confidence interval."""

    mean: float
    low: float
    high: float
    n: int
    """How many units (tasks or episodes) the estimate rests on."""

    def to_dict(self) -> dict[str, float | int]:
        return {"mean": self.mean, "low": self.low, "high": self.high, "n": self.n}


# ---------------------------------------------------------------- pass@k and maj@k


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, HumanEval).

    1 - C(n-c, k) / C(n, k), in the product form 1 - prod_{i=n-c+1..n} (1 - k/i), which
    never forms the huge binomials.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c={c} must be between 0 and n={n}")
    if not 1 <= k <= n:
        raise ValueError(
            f"pass_at_k: k={k} must be between 1 and n={n}; sample at least k episodes per task"
        )
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def majority_answer(answers: Sequence[str]) -> str:
    """The most frequent answer; ties go to the lexicographically smallest, so the vote does
    not depend on the order in which episodes finished."""
    if not answers:
        raise ValueError("majority_answer needs at least one answer")
    counts = Counter(answers)
    return min(counts, key=lambda a: (-counts[a], a))


def maj_at_k(answers: Sequence[str], correct: Sequence[bool]) -> bool:
    """Whether the majority-voted answer is correct; `correct[i]` grades `answers[i]`.

    The voted answer counts as correct when any episode that gave it was graded correct
    (an env grades the same answer the same way, so they agree in practice).
    """
    if len(answers) != len(correct):
        raise ValueError(f"maj_at_k: {len(answers)} answers but {len(correct)} grades")
    winner = majority_answer(answers)
    return any(ok for a, ok in zip(answers, correct, strict=True) if a == winner)


def pass_at_k_levels(k: int) -> list[int]:
    """The k values reported for a run with k episodes per task: 1, 2, 4, ... and k."""
    levels = [1]
    while levels[-1] * 2 < k:
        levels.append(levels[-1] * 2)
    if k > 1:
        levels.append(k)
    return levels


# ---------------------------------------------------------------- intervals


def t_critical(df: int, confidence: float = 0.95) -> float:
    """The two-sided Student-t critical value, e.g. t_critical(10) = 2.228.

    P(|T| >= t) is the regularized incomplete beta I_x(df/2, 1/2) at x = df / (df + t^2):
    mpmath (a dependency of torch's sympy) solves it for x.
    """
    import mpmath

    if df < 1:
        raise ValueError(f"t_critical: df={df} must be at least 1")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence} must be in (0, 1), e.g. 0.95")
    if df > 1000:  # the t distribution is normal to 4 decimals here
        return NormalDist().inv_cdf(0.5 + confidence / 2)

    def excess_tail(x: float) -> Any:
        return mpmath.betainc(df / 2, 0.5, 0, x, regularized=True) - (1 - confidence)

    # illinois keeps the root bracketed in (0, 1), where the tail grows with x
    x = mpmath.findroot(excess_tail, (0, 1), solver="illinois", verify=False)
    return math.sqrt(df * (1 - x) / x)


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """Mean with a Student-t confidence interval (mean ± t * s / sqrt(n)).

    One value gives a degenerate interval at the mean; no values give NaN.
    """
    n = len(values)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    mean = math.fsum(values) / n
    if n == 1:
        return Interval(mean, mean, mean, 1)
    half = t_critical(n - 1, confidence) * statistics.stdev(values) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def paired_diff_ci(
    before: dict[str, float], after: dict[str, float], confidence: float = 0.95
) -> Interval:
    """Mean of `after[t] - before[t]` over the tasks t both hold, with a Student-t interval on
    those per-task differences: a paired comparison, so each task's difficulty cancels."""
    common = sorted(before.keys() & after.keys())
    return mean_ci([after[t] - before[t] for t in common], confidence)


def task_mean_ci(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """The interval for a mean over tasks: Wilson when every value is 0 or 1 (a t interval
    collapses to a point at 0/n or n/n), else Student t."""
    if values and all(v in (0.0, 1.0) for v in values):
        return wilson_ci(int(sum(values)), len(values), confidence)
    return mean_ci(values, confidence)


def wilson_ci(successes: int, n: int, confidence: float = 0.95) -> Interval:
    """A binomial proportion with the Wilson score interval (sane at 0/n and n/n)."""
    if not 0 <= successes <= n:
        raise ValueError(f"wilson_ci: successes={successes} must be between 0 and n={n}")
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / n
    denom = 1.0 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return Interval(p, max(0.0, center - half), min(1.0, center + half), n)


def std(values: Sequence[float]) -> float:
    """Population standard deviation (0.0 for fewer than two values)."""
    return statistics.pstdev(values) if len(values) > 1 else 0.0


# ---------------------------------------------------------------- episodes


def is_scored(traj: Trajectory) -> bool:
    """COMPLETED and TRUNCATED episodes are scored; ERROR and ABORTED are infrastructure
    outcomes that never enter a reward mean (they are not a reward of 0). So is a reward that
    is no finite number, in a file written before rewards were checked: one NaN would make
    every mean and interval NaN (and `statistics.stdev` raise)."""
    return EpisodeStatus(traj.status).is_trainable and math.isfinite(traj.reward)


def is_correct(traj: Trajectory) -> bool:
    """`info["correct"]` when the env reports it, else reward > 0."""
    if "correct" in traj.info:
        return bool(traj.info["correct"])
    return traj.reward > 0


def reward_components(traj: Trajectory) -> dict[str, float]:
    """The numeric and boolean entries of `info["reward_components"]`, as floats: what an env
    reports beside the reward it pays (search_r1: em, f1, format, is_answered, ...)."""
    components = traj.info.get("reward_components") or {}
    return {
        name: float(value)
        for name, value in components.items()
        if isinstance(value, int | float) and math.isfinite(float(value))
    }


ANSWER_KEYS = ("predicted", "answer")
"""`info` keys holding the model's parsed answer, first found wins (the calculator env keeps
its gold answer under "answer" and the model's under "predicted")."""


def extract_answer(traj: Trajectory) -> str:
    """The model's answer as the env parsed it (`info["predicted"]` or `info["answer"]`; None,
    i.e. no parseable answer, votes as ""), else the last assistant turn's text.
    Whitespace is normalised so formatting differences do not split the vote."""
    for key in ANSWER_KEYS:
        if key in traj.info:
            answer = traj.info[key]
            return "" if answer is None else " ".join(str(answer).split())
    return " ".join(traj.turns[-1].text.split()) if traj.turns else ""


def num_tool_calls(traj: Trajectory) -> int:
    return sum(turn.num_tool_calls for turn in traj.turns)


def num_tool_errors(traj: Trajectory) -> int:
    return sum(turn.num_tool_errors for turn in traj.turns)
