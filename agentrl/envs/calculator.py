"""The old import path of the built-in calculator env, now `agentrl.envs.builtin.calculator`.
Kept only while tests/agents/test_capture.py, tests/engine/serve/test_server.py and
scripts/bench_rollout.py import `CalculatorEnv` from here; delete it once they do not."""

from __future__ import annotations

from agentrl.envs.builtin.calculator import CalculatorEnv

__all__ = ["CalculatorEnv"]
