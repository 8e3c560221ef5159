"""`EpisodeCapture`: an agent's chat completions, recorded token for token as trajectory segments.

Each call's messages are matched against the conversations recorded so far: a call that
extends one (its messages start with that conversation and the reply we gave) continues it,
and only the new messages are rendered, as an observation delta after the sampled ids (mask
0); any other call (history rewritten, compacted, a sub-agent) starts a new segment."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from agentrl.engine.base import Completion, SamplingParams
from agentrl.rollout.codec import ChatCodec
from agentrl.rollout.episode import EpisodeRecord
from agentrl.types import EpisodeStatus, Message, StatusReason, Task, Trajectory


@dataclass
class Segment(EpisodeRecord):
    """One conversation's token stream: the prompt, then sampled ids and observation deltas."""

    messages: list[Message] = field(default_factory=list)
    """The conversation so far, ending with the assistant reply this segment sampled last."""
    tools_key: str = ""
    last_sampled_ids: list[int] = field(default_factory=list)
    is_extended: bool = False
    """A later call continued this conversation: it lives on in that call's segment."""


@dataclass
class PendingCall:
    """A call's prompt ids, and the segment it continues (None: a new segment)."""

    prompt_ids: list[int]
    parent: Segment | None
    messages: list[Message]
    tools_key: str


def normalize_messages(raw: list[dict[str, Any]]) -> list[Message]:
    """OpenAI request messages as `Message`s: content parts joined, `None` content as "",
    tool-call arguments as compact JSON, so an echoed reply compares equal to what we sent;
    OpenAI's "developer" role is the chat template's "system"."""
    out = []
    for d in raw:
        content = d.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        role = "system" if d.get("role") == "developer" else d.get("role")
        message = Message.from_dict({**d, "role": role, "content": content or ""})
        for call in message.tool_calls:
            call.arguments = _canonical_json(call.arguments)
        out.append(message)
    return out


def _canonical_json(text: str) -> str:
    try:
        return json.dumps(json.loads(text), ensure_ascii=False, sort_keys=True)
    except (json.JSONDecodeError, TypeError):
        return text


def tools_key(tools: list[dict[str, Any]] | None) -> str:
    return json.dumps(tools or [], sort_keys=True)


class EpisodeCapture:
    """Every chat completion of one agent episode; `trajectories()` gives its segments."""

    def __init__(self, codec: ChatCodec, task: Task, *, group_id: str, episode_id: str) -> None:
        self.codec = codec
        self.task = task
        self.group_id = group_id
        self.episode_id = episode_id
        self.segments: list[Segment] = []
        self.num_calls = 0
        self.ending: tuple[EpisodeStatus, StatusReason] | None = None
        """Set when a limit or the engine ended the episode: it outranks the agent's outcome."""
        self.info: dict[str, Any] = {}

    def prepare(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> PendingCall:
        """The prompt ids of a call: a delta after the segment it extends, else a full render."""
        key = tools_key(tools)
        parent = self._parent(messages, key)
        if parent is None:
            ids = self.codec.render_prompt(messages, tools)
        else:
            delta = messages[len(parent.messages) :]
            ids = parent.token_ids + self.codec.render_observation(
                delta, sampled_ids=parent.last_sampled_ids
            )
        return PendingCall(ids, parent, messages, key)

    def _parent(self, messages: list[Message], key: str) -> Segment | None:
        # The latest conversation first: an agent usually continues what it did last.
        for segment in reversed(self.segments):
            n = len(segment.messages)
            if (
                segment.tools_key == key
                and len(messages) > n
                and messages[:n] == segment.messages
                and messages[-1].role != "assistant"
            ):
                return segment
        return None

    def record(
        self, call: PendingCall, completion: Completion, reply: Message, sampling: SamplingParams
    ) -> None:
        """Add one sampled choice of `call`: its ids and logprobs verbatim (mask 1)."""
        segment = Segment(self.task, self.group_id, self.episode_id)
        segment.messages = [*call.messages, reply]
        segment.tools_key = call.tools_key
        parent = call.parent
        if parent is None:
            segment.add_prompt(call.prompt_ids)
        else:  # the delta (tool results, user turns) is masked: the policy did not write it
            parent.is_extended = True
            segment.token_ids = list(parent.token_ids)
            segment.loss_mask = list(parent.loss_mask)
            segment.logprobs = list(parent.logprobs)
            segment.prompt_len = parent.prompt_len
            segment.turns = [dataclasses.replace(t) for t in parent.turns]
            segment.add_observation(call.prompt_ids[len(parent.token_ids) :])
        turn = segment.add_sampled(completion, self.codec.decode(completion.ids), sampling)
        turn.num_tool_calls = len(reply.tool_calls)
        segment.last_sampled_ids = list(completion.ids)
        self.segments.append(segment)

    def trajectories(
        self, reward: float, status: EpisodeStatus, reason: StatusReason
    ) -> list[Trajectory]:
        """One trajectory per conversation no later call continued, each with the episode's
        reward and status; `info["segment"]` numbers them within the episode."""
        leaves = [s for s in self.segments if not s.is_extended]
        for index, segment in enumerate(leaves):
            segment.reward = reward
            segment.info = {**self.info, "segment": index, "num_segments": len(leaves)}
            segment.info["num_calls"] = self.num_calls
        return [segment.finish((status, reason)) for segment in leaves]
