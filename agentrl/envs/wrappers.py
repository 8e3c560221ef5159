"""Single-purpose wrappers that stop an episode from outside: `MaxTurns`, `WallClock`,
`TokenBudget`. Each sets `truncated=True` and `info["truncated_reason"]` (a StatusReason value)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from agentrl.envs.base import AgentEnv, StepResult
from agentrl.tools import ToolRegistry
from agentrl.types import Message, StatusReason, Task


def _forwarded(name: str) -> Any:
    """A read-only property reading `name` off the wrapped env."""
    return property(lambda self: getattr(self.env, name))


class Wrapper(AgentEnv):
    """Passes everything to the wrapped env; subclasses change `reset`/`step` only."""

    def __init__(self, env: AgentEnv) -> None:  # no super().__init__: tools belong to `env`
        self.env = env

    def __getattr__(self, name: str) -> Any:
        if name == "env":  # not set yet (e.g. during unpickling): avoid recursing
            raise AttributeError(name)
        return getattr(self.env, name)

    # Class-level attributes of AgentEnv would shadow __getattr__, so they are forwarded explicitly.
    reward_range = _forwarded("reward_range")
    tool_call_format = _forwarded("tool_call_format")
    stop = _forwarded("stop")
    metadata = _forwarded("metadata")
    max_observation_tokens = _forwarded("max_observation_tokens")

    @property
    def tools(self) -> ToolRegistry:  # type: ignore[override]
        return self.env.tools

    @tools.setter
    def tools(self, value: ToolRegistry) -> None:
        self.env.tools = value

    @property
    def unwrapped(self) -> AgentEnv:
        return self.env.unwrapped

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        return await self.env.reset(seed=seed, options=options)

    async def step(self, action: Message) -> StepResult:
        return await self.env.step(action)

    async def close(self) -> None:
        await self.env.close()

    async def call_tools(self, action: Message) -> list:
        return await self.env.call_tools(action)

    def load_tasks(self, split: str, **kwargs: Any) -> list[Task]:  # type: ignore[override]
        return self.env.load_tasks(split, **kwargs)

    def task_from_row(self, row: dict[str, Any], **kwargs: Any) -> Task:  # type: ignore[override]
        return self.env.task_from_row(row, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.env!r})"


def _truncate(result: StepResult, reason: StatusReason) -> StepResult:
    """Mark a still-running episode truncated; a terminated or already truncated one keeps its ending."""
    if not (result.terminated or result.truncated):
        result.truncated = True
        result.info["truncated_reason"] = reason.value
    return result


class MaxTurns(Wrapper):
    """Truncates after `max_turns` steps (assistant turns) since reset."""

    def __init__(self, env: AgentEnv, max_turns: int) -> None:
        if max_turns < 1:
            raise ValueError(f"MaxTurns(max_turns={max_turns}): use an int >= 1")
        super().__init__(env)
        self.max_turns = max_turns
        self.num_turns = 0

    async def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self.num_turns = 0
        return await self.env.reset(seed=seed, options=options)

    async def step(self, action: Message) -> StepResult:
        result = await self.env.step(action)
        self.num_turns += 1
        if self.num_turns >= self.max_turns:
            _truncate(result, StatusReason.MAX_TURNS)
        return result


class WallClock(Wrapper):
    """Truncates once `seconds` have passed since reset, model time included. A step still
    running at the deadline is cancelled and answered with an empty truncated result."""

    def __init__(self, env: AgentEnv, seconds: float) -> None:
        if seconds <= 0:
            raise ValueError(f"WallClock(seconds={seconds}): use a positive number of seconds")
        super().__init__(env)
        self.seconds = seconds
        self.deadline = float("inf")

    async def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self.deadline = time.monotonic() + self.seconds
        return await self.env.reset(seed=seed, options=options)

    async def step(self, action: Message) -> StepResult:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            return _truncate(StepResult(), StatusReason.WALL_CLOCK)
        try:
            result = await asyncio.wait_for(self.env.step(action), timeout=remaining)
        except asyncio.TimeoutError:
            return _truncate(StepResult(), StatusReason.WALL_CLOCK)
        if time.monotonic() >= self.deadline:
            _truncate(result, StatusReason.WALL_CLOCK)
        return result


class TokenBudget(Wrapper):
    """Truncates once the model's responses in this episode reach `max_tokens` tokens.

    Counts each action's content and tool-call text with the tools' tokenizer (the runner
    binds its chat codec there), else about 4 characters per token. The runner's own per-turn
    limits are exact; this caps the episode total.
    """

    def __init__(self, env: AgentEnv, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"TokenBudget(max_tokens={max_tokens}): use an int >= 1")
        super().__init__(env)
        self.max_tokens = max_tokens
        self.num_tokens = 0

    async def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self.num_tokens = 0
        return await self.env.reset(seed=seed, options=options)

    async def step(self, action: Message) -> StepResult:
        result = await self.env.step(action)
        self.num_tokens += self.count_tokens(action)
        if self.num_tokens >= self.max_tokens:
            _truncate(result, StatusReason.LENGTH)
        return result

    def count_tokens(self, action: Message) -> int:
        text = action.content + "".join(tc.name + tc.arguments for tc in action.tool_calls)
        if self.tools.tokenizer is not None:
            return len(self.tools.tokenizer.encode(text))
        return (len(text) + 3) // 4
