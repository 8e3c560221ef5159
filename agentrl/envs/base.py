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


class EnvLoadError(ImportError):
    """An env's entry point names something that cannot be imported."""


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
            f"{cls.__name__} ships no tasks; pass a data file of JSON rows, or write "
            f"{cls.__name__}.load_tasks(split)"
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
        """Turn one row of a user's JSONL/parquet file (`index`: its place from 0) into a Task.

        The default keeps the row's fields in `Task.data` as they are, so `reset` reads a row
        `{"country": "France"}` as `task.data["country"]`, and adds `question` and `answer` from
        `input_key` / `label_key` (unset: the row's `question` or `prompt`, its `answer` or
        `label`, where present). The id is the row's own `id`, else `row-<index>`. Override it
        to check or reshape rows; a missing field raises ValueError naming the row and field."""
        keys = {"question": input_key, "answer": label_key}
        named = {name: _row_field(cls, row, index, name, key) for name, key in keys.items()}
        data = {**row, **{name: row[key] for name, key in named.items() if key is not None}}
        return Task(id=_row_id(row, index), data=data)

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


# Where a row's question and answer are read from when --input-key / --label-key are unset.
_ROW_KEYS = {"question": ("question", "prompt"), "answer": ("answer", "label")}
_ROW_FLAGS = {"question": "--input-key (env.input_key)", "answer": "--label-key (env.label_key)"}


def _row_field(
    cls: type, row: dict[str, Any], index: int, name: str, key: str | None
) -> str | None:
    """The field of `row` that `key` names (it must be there), else the first of `name`'s
    usual fields present, else None."""
    if key is None:
        return next((k for k in _ROW_KEYS[name] if k in row), None)
    if key not in row:
        raise ValueError(
            f"row {index}: no field {key!r} (fields: {sorted(row)}); pass {_ROW_FLAGS[name]} "
            f"with one of them, or write {cls.__name__}.task_from_row to read these rows"
        )
    return key


def _row_id(row: dict[str, Any], index: int) -> str:
    """The row's own `id` (a string or an integer), else its place in the file."""
    own = row.get("id")
    if isinstance(own, (str, int)) and not isinstance(own, bool) and str(own).strip():
        return str(own)
    return f"row-{index}"


def _off_loop(fn):
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(fn, *args, **kwargs)

    return wrapper
