"""`AgentEnv` and `StepResult`: the Gymnasium-style contract every environment implements."""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from agentrl.tools import ToolRegistry, ToolResult
from agentrl.types import Message, Task


@dataclass
class StepResult:
    """What `env.step` returns. Unpacks like Gymnasium's five-tuple.

    `observation` holds the messages the env answers with (tool replies, a user hint); they
    are rendered after the sampled tokens and masked out of the loss. `terminated` = the task
    ended (answer given, tests ran); `truncated` = stopped from outside, with
    `info["truncated_reason"]` naming why.
    """

    observation: list[Message] = field(default_factory=list)
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    def __iter__(self):
        return iter((self.observation, self.reward, self.terminated, self.truncated, self.info))


class AgentEnv:
    """Base class for agent environments. One instance serves one episode at a time.

    Subclasses implement `reset` and `step`, either `async def` or plain `def`; plain methods
    run in a worker thread so blocking code never stalls the rollout's event loop.
    The task row arrives as `options["task"]` (an `agentrl.types.Task`).
    """

    tools: ToolRegistry
    """The tools the model sees (rendered into the prompt by the chat template)."""
    reward_range: ClassVar[tuple[float, float]] = (-math.inf, math.inf)
    tool_call_format: ClassVar[Literal["hermes", "tags"]] = "hermes"
    """How the codec parses actions: `hermes` = `<tool_call>{json}</tool_call>`;
    `tags` = Search-R1-style `<name>argument</name>` for each tool name (and `<answer>`)."""
    stop: ClassVar[tuple[str, ...]] = ()
    """Extra stop strings for the engine (kept in the output), e.g. ("</search>", "</answer>")."""
    max_observation_tokens: int | None = None
    """Token budget of one step's observation: the codec cuts longer ones, keeping each message's
    head and tail (the runner's `rollout.max_observation_tokens` applies too, the smaller wins)."""
    metadata: ClassVar[dict[str, Any]] = {}

    def __init__(self) -> None:
        self.tools = ToolRegistry()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in ("reset", "step", "close"):
            fn = cls.__dict__.get(name)
            if fn is not None and not inspect.iscoroutinefunction(fn):
                setattr(cls, name, _off_loop(fn))

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        raise NotImplementedError

    async def step(self, action: Message) -> StepResult:
        raise NotImplementedError

    async def close(self) -> None:
        return None

    @classmethod
    def load_tasks(cls, split: str, **kwargs: Any) -> list[Task]:
        """The env's own dataset split ("train", "test", maybe "dev"), in a fixed order."""
        raise NotImplementedError(
            f"{cls.__name__} ships no tasks; pass a data file (--prompt-data / --data)"
        )

    @classmethod
    def task_from_row(
        cls,
        row: dict[str, Any],
        *,
        index: int,
        input_key: str | None = None,
        label_key: str | None = None,
    ) -> Task:
        """Turn one row of a user's JSONL/parquet file into a Task; a row missing a field
        raises ValueError naming the row index and the field."""
        raise NotImplementedError(f"{cls.__name__} cannot read user data rows")

    async def call_tools(self, action: Message) -> list[ToolResult]:
        """Run every tool call in `action` concurrently, results in call order; failures come
        back as error results (`is_error`), never as exceptions.

        The observation is `[r.message for r in results]`; put `tool_info(results)` in the
        StepResult's info."""
        return list(await asyncio.gather(*(self.tools.call(tc) for tc in action.tool_calls)))

    @property
    def unwrapped(self) -> AgentEnv:
        """The innermost env under any wrappers."""
        return self


def tool_info(results: list[ToolResult]) -> dict[str, int]:
    """The `num_tool_calls` / `num_tool_errors` entries every env puts into its step info."""
    return {"num_tool_calls": len(results), "num_tool_errors": sum(r.is_error for r in results)}


def _off_loop(fn):
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(fn, *args, **kwargs)

    return wrapper
