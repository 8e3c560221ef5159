"""Agent environments: the `AgentEnv` contract, the id registry and `check_env`."""

from __future__ import annotations

from agentrl.envs.base import AgentEnv, StepResult, tool_info
from agentrl.envs.check import EnvCheckError, check_env
from agentrl.envs.registry import (
    EnvLoadError,
    EnvSpec,
    UnknownEnvError,
    list_envs,
    make,
    register,
    spec,
)

register(
    "calculator",
    "agentrl.envs.builtin.calculator:CalculatorEnv",
    description="Arithmetic word problems with a `calculate` tool; reward 1 for the exact answer, "
    "0.1 for a wrong tagged answer given after a tool result.",
)
register(
    "slow_tools",
    "agentrl.envs.builtin.slow_tools:SlowToolsEnv",
    description="Simulated key lookup whose tool latency is lognormal (p99 >= 10x median), "
    "for async training tests and benchmarks.",
)

__all__ = [
    "AgentEnv",
    "EnvCheckError",
    "EnvLoadError",
    "EnvSpec",
    "StepResult",
    "UnknownEnvError",
    "check_env",
    "list_envs",
    "make",
    "register",
    "spec",
    "tool_info",
]
