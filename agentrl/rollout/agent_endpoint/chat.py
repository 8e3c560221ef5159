"""One OpenAI chat completion inside an agent episode: rendered by the codec, sampled by the
run's engine, parsed into OpenAI's `tool_calls`, recorded by the episode's `EpisodeCapture`,
and answered in OpenAI's shape (SGLang's `prompt_token_ids`/`response_token_ids`, `metadata.weight_version`)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import traceback
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentrl.engine.base import Completion, Engine, EngineUnavailable, FinishReason, SamplingParams
from agentrl.rollout.agent_endpoint.capture import EpisodeCapture, PendingCall, normalize_messages
from agentrl.types import EpisodeStatus, Message, StatusReason, ToolCall


class AgentMessage(BaseModel):
    """A request message with a role the chat codec renders ("developer" is read as "system"):
    any other role is a 400 naming it, as OpenAI and SGLang answer. Other fields pass as sent."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None


class ChatRequest(BaseModel):
    """The fields of OpenAI's chat completion request that agentrl reads; others are ignored.
    Sampling follows the run (temperature, top_p, top_k, seed), as the policy's logprobs must:
    an agent's own `temperature` would train on a distribution the trainer does not score."""

    model_config = ConfigDict(extra="allow")

    messages: list[AgentMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    n: int = Field(default=1, ge=1, le=16)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    logprobs: bool = False


class ChatError(Exception):
    """A call the endpoint refuses: answered with `status` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class CallLimits:
    max_calls: int
    max_context_len: int


async def complete(
    capture: EpisodeCapture,
    engine: Engine,
    sampling: SamplingParams,
    limits: CallLimits,
    body: ChatRequest,
) -> dict[str, Any]:
    """Sample `body.n` choices for one call and record them; the response body."""
    if capture.ending is not None:
        raise ChatError(400, f"this episode has ended ({capture.ending[1].value}); start a new one")
    if capture.num_calls >= limits.max_calls:
        capture.ending = (EpisodeStatus.TRUNCATED, StatusReason.MAX_TURNS)
        raise ChatError(400, f"this episode made its {limits.max_calls} calls (rollout.max_turns)")
    # The turn is taken before the first await: calls made at once each see the ones before.
    index = capture.num_calls
    capture.num_calls += 1
    try:
        messages = normalize_messages([m.model_dump() for m in body.messages])
        call = await asyncio.to_thread(capture.prepare, messages, body.tools)
    except Exception as e:
        capture.num_calls -= 1  # refused before sampling: the turn was not played
        raise ChatError(400, f"messages: the chat template failed on them: {e}") from e
    room = limits.max_context_len - len(call.prompt_ids)
    if room <= 0:
        capture.ending = (EpisodeStatus.TRUNCATED, StatusReason.CONTEXT)
        raise ChatError(400, f"messages: {len(call.prompt_ids)} tokens fill the context window")
    choices = [_choice_sampling(sampling, body, room, index, i) for i in range(body.n)]
    runs = [
        engine.generate(list(call.prompt_ids), choice, routing_key=capture.episode_id)
        for choice in choices
    ]
    completions = await _sample(capture, runs)
    replies = [_reply(capture, c, body) for c in completions]
    for completion, reply, choice in zip(completions, replies, choices, strict=True):
        capture.record(call, completion, reply, choice)
    return _response(call, completions, replies, body)


def _choice_sampling(
    base: SamplingParams, body: ChatRequest, room: int, call_index: int, choice: int
) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    asked = body.max_completion_tokens or body.max_tokens or base.max_new_tokens
    seed = None if base.seed is None else (base.seed + 7919 * call_index + choice) % (1 << 31)
    return dataclasses.replace(
        base,
        max_new_tokens=min(asked, base.max_new_tokens, room),
        stop=list(dict.fromkeys([*base.stop, *stop])),
        seed=seed,
    )


async def _sample(capture: EpisodeCapture, runs: list[Any]) -> list[Completion]:
    try:
        completions = list(await asyncio.gather(*runs))
    except EngineUnavailable as e:  # a dead or restarted server: run the episode again later
        capture.ending = (EpisodeStatus.ABORTED, StatusReason.ENGINE)
        capture.info.update(error=traceback.format_exc(limit=1), error_where="engine.generate")
        raise ChatError(503, f"the engine is unavailable: {e}") from e
    except Exception as e:
        capture.ending = (EpisodeStatus.ERROR, StatusReason.ENGINE)
        capture.info.update(error=traceback.format_exc(), error_where="engine.generate")
        raise ChatError(502, f"the engine failed: {type(e).__name__}: {e}") from e
    if any(c.finish_reason == FinishReason.ABORT for c in completions):
        capture.ending = (EpisodeStatus.ABORTED, StatusReason.CANCELLED)
        raise ChatError(503, "the generation was aborted (a weight update or shutdown)")
    return completions


def _reply(capture: EpisodeCapture, completion: Completion, body: ChatRequest) -> Message:
    """The assistant message the sampled ids spell, with ids OpenAI's schema requires."""
    parsed = capture.codec.parse(completion.ids, body.tools)
    calls = [
        ToolCall(name=c.name, arguments=c.arguments, id=f"call_{uuid.uuid4().hex[:24]}")
        for c in parsed.tool_calls
    ]
    # The agent echoes this reply back; normalizing it the same way makes the echo match.
    return normalize_messages(
        [Message(role="assistant", content=parsed.content, tool_calls=calls).to_dict()]
    )[0]


def _finish_reason(completion: Completion, reply: Message) -> str:
    if completion.finish_reason == FinishReason.LENGTH:
        return "length"
    return "tool_calls" if reply.tool_calls else "stop"


def _response(
    call: PendingCall, completions: list[Completion], replies: list[Message], body: ChatRequest
) -> dict[str, Any]:
    choices = []
    for index, (c, reply) in enumerate(zip(completions, replies, strict=True)):
        message: dict[str, Any] = {"role": "assistant", "content": reply.content or None}
        if reply.tool_calls:
            message["tool_calls"] = [tc.to_dict() for tc in reply.tool_calls]
        choice: dict[str, Any] = {
            "index": index,
            "message": message,
            "finish_reason": _finish_reason(c, reply),
            "logprobs": None,
            "prompt_token_ids": list(call.prompt_ids),  # SGLang's names (return_token_ids)
            "response_token_ids": list(c.ids),
        }
        if body.logprobs:
            choice["logprobs"] = {
                "content": [
                    {"token": str(t), "logprob": lp, "bytes": None, "top_logprobs": []}
                    for t, lp in zip(c.ids, c.logprobs, strict=True)
                ]
            }
        choices.append(choice)
    num_completion = sum(len(c.ids) for c in completions)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": "agentrl-policy",
        "choices": choices,
        "usage": {
            "prompt_tokens": len(call.prompt_ids),
            "completion_tokens": num_completion,
            "total_tokens": len(call.prompt_ids) + num_completion,
        },
        "metadata": {"weight_version": str(completions[0].weight_version)},
    }
