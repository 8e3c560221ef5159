"""The shared vocabulary: messages, tool calls, tasks, episode statuses and the `Trajectory`
(with its `Group` and its JSONL form) that rollout, trainer, run and eval all pass along."""

from __future__ import annotations

import enum
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import pydantic

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


@dataclass
class Turn:
    """One assistant generation plus the env's reply, as spans of `Trajectory.token_ids`."""

    start: int
    """Index in token_ids of the first sampled id of this turn."""
    num_sampled: int
    """Sampled ids (mask 1), verbatim from the engine."""
    num_observation: int
    """Observation ids appended after them (mask 0); 0 on the last turn."""
    weight_version: int
    """The version that sampled the turn's last token (and all of them unless version_spans)."""
    finish_reason: str
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    text: str = ""
    """The decoded sampled text (for display; never re-tokenized)."""
    served_by: str = ""
    """The engine server that sampled this turn (its base URL; "" for an in-process engine or
    behind sglang_router, which does not say). All turns of an episode go to one server, which
    holds its prefix (routing key)."""
    temperature: float = 1.0
    top_k: int = -1
    """-1 = off."""
    top_p: float = 1.0
    """The sampling parameters of this turn (temperature 0 = greedy)."""
    is_logprob_truncated: bool = False
    """The engine's logprobs are of the top-k/top-p truncated distribution (the embedded engine,
    `agentrl serve`); the trainer then computes its own under the same truncation. False: of the
    whole softmax (SGLang), and so are the trainer's."""
    version_spans: list[tuple[int, int]] = field(default_factory=list)
    """(weight version, sampled tokens) in order when the turn straddled a weight update (a
    retracted request went on under new weights); empty: every token by weight_version."""

    def token_versions(self) -> list[int]:
        """The weight version that sampled each of this turn's tokens."""
        if not self.version_spans:
            return [self.weight_version] * self.num_sampled
        return [version for version, n in self.version_spans for _ in range(n)]


@dataclass
class Trajectory:
    """Invariants: len(loss_mask) == len(token_ids); loss_mask is 1 exactly on sampled ids;
    len(logprobs) == sum(loss_mask), in order; the prompt occupies token_ids[:prompt_len]."""

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    prompt_len: int
    reward: float
    status: EpisodeStatus
    status_reason: StatusReason
    turns: list[Turn] = field(default_factory=list)
    task: dict[str, Any] = field(default_factory=dict)
    group_id: str = ""
    episode_id: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    """Reward components, the env's final info, error traceback (for ERROR), timings."""

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def num_sampled(self) -> int:
        return len(self.logprobs)

    @property
    def response_len(self) -> int:
        return len(self.token_ids) - self.prompt_len

    def check(self) -> None:
        """Raise ValueError if the invariants above do not hold."""
        if len(self.loss_mask) != len(self.token_ids):
            raise ValueError(
                f"loss_mask has {len(self.loss_mask)} entries for {len(self.token_ids)} token ids"
            )
        if sum(self.loss_mask) != len(self.logprobs):
            raise ValueError(
                f"{sum(self.loss_mask)} tokens are trained but {len(self.logprobs)} logprobs are stored"
            )
        if any(self.loss_mask[: self.prompt_len]):
            raise ValueError("a prompt token is marked trainable")
        for turn in self.turns:
            span = self.loss_mask[turn.start : turn.start + turn.num_sampled]
            obs = self.loss_mask[
                turn.start + turn.num_sampled : turn.start + turn.num_sampled + turn.num_observation
            ]
            if not all(span) or any(obs):
                raise ValueError(f"turn at {turn.start} does not match loss_mask")
            if turn.version_spans and sum(n for _, n in turn.version_spans) != turn.num_sampled:
                raise ValueError(
                    f"turn at {turn.start}: version_spans cover "
                    f"{sum(n for _, n in turn.version_spans)} tokens of {turn.num_sampled}"
                )

    def to_json(self) -> dict[str, Any]:
        """The JSON form (enums as their values), with `num_turns` for readers of the file."""
        return {**_JSON.dump_python(self, mode="json"), "num_turns": self.num_turns}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Trajectory:
        return _JSON.validate_python(d)  # `num_turns`, derived, is ignored


_JSON = pydantic.TypeAdapter(Trajectory)

Group = list[Trajectory]
"""The trajectories of one task: n episodes (an agent's episode may add several segments)."""


def write_jsonl(path: str, trajectories: list[Trajectory], *, append: bool = False) -> None:
    """Write one trajectory per line, flushed to disk so a crash loses nothing written."""
    with open(path, "a" if append else "w", encoding="utf-8") as f:
        for t in trajectories:
            f.write(json.dumps(t.to_json()) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str) -> list[Trajectory]:
    with open(path, encoding="utf-8") as f:
        return [Trajectory.from_json(json.loads(line)) for line in f if line.strip()]
