"""Rewards beyond an env's own checks: an LLM judge scoring answers on a weighted rubric."""

from __future__ import annotations

from agentrl.rewards.judge import Judge, JudgeError, engine_backend, judge, openai_backend
from agentrl.rewards.rubric import Criterion, JudgeScore, Rubric

__all__ = [
    "Criterion",
    "Judge",
    "JudgeError",
    "JudgeScore",
    "Rubric",
    "engine_backend",
    "judge",
    "openai_backend",
]
