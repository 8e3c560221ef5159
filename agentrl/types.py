"""The shared vocabulary: messages, tool calls, tasks and episode statuses."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]


@dataclass
class ToolCall:
    """One function call as the model wrote it (OpenAI shape).

    `arguments` is the raw JSON text the model produced; the tool registry parses and
    validates it, so a malformed call reaches the registry and becomes an observation.
    """

    name: str
    arguments: str
    id: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class Message:
    """A chat message. `tool_calls` only on assistant messages, `tool_call_id` on tool replies."""

    role: Role
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The dict a chat template (and the OpenAI API) expects."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [tc.to_dict() for tc in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Message:
        calls = []
        for tc in d.get("tool_calls") or []:
            fn = tc.get("function", tc)
            args = fn.get("arguments", "")
            if not isinstance(args, str):
                import json

                args = json.dumps(args)
            calls.append(ToolCall(name=fn.get("name", ""), arguments=args, id=tc.get("id", "")))
        return cls(
            role=d["role"],
            content=d.get("content") or "",
            tool_calls=calls,
            tool_call_id=d.get("tool_call_id"),
            name=d.get("name"),
        )


@dataclass
class Task:
    """One dataset row handed to `env.reset(options={"task": task})`.

    `id` is stable across runs (data cursors and eval resumption key on it), `data` holds
    the row as the env understands it (question, answers, tests...).
    """

    id: str
    data: dict[str, Any]
    split: str = "train"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class EpisodeStatus(str, enum.Enum):
    """How an episode ended. ERROR and ABORTED are infrastructure outcomes: they never enter
    the loss or group statistics, and are never scored as reward 0."""

    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ERROR = "error"
    ABORTED = "aborted"

    @property
    def is_trainable(self) -> bool:
        return self in (EpisodeStatus.COMPLETED, EpisodeStatus.TRUNCATED)


class StatusReason(str, enum.Enum):
    """Why an episode got its status; one reason per code path that sets it."""

    DONE = "done"  # COMPLETED: the env terminated the episode
    MAX_TURNS = "max_turns"  # TRUNCATED ...
    CONTEXT = "context"  # the next turn would not fit the context window
    LENGTH = "length"  # the response hit the token budget for the episode
    WALL_CLOCK = "wall_clock"
    TOOL = "tool"  # ERROR ... : tool infrastructure (e.g. sandbox) failed
    PARSE = "parse"
    ENV = "env"  # the env raised
    ENGINE = "engine"  # the inference engine failed
    NON_FINITE_REWARD = "non_finite_reward"  # the env, agent or judge paid NaN, inf or no number
    CANCELLED = "cancelled"  # ABORTED: stopped by the runner (shutdown, weight update drain)
