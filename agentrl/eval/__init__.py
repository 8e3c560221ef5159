"""Held-out evaluation: `evaluate`, pass@k / maj@k with confidence intervals, and reports."""

from __future__ import annotations

from agentrl.eval.report import EvalReport, build_report, plot_eval_history, plot_report
from agentrl.eval.runner import ResumeMismatchError, evaluate
from agentrl.eval.stats import Interval, maj_at_k, mean_ci, pass_at_k, wilson_ci

__all__ = [
    "EvalReport",
    "Interval",
    "ResumeMismatchError",
    "build_report",
    "evaluate",
    "maj_at_k",
    "mean_ci",
    "pass_at_k",
    "plot_eval_history",
    "plot_report",
    "wilson_ci",
]
