"""The Anthropic Messages shape (`POST /v1/messages`) over the same capture as chat
completions: requests become OpenAI-style messages (tool_use -> tool_calls, tool_result ->
role "tool"), replies become content blocks, so an agent on either API records the same way."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agentrl.rollout.agent.chat import ChatRequest


class MessagesRequest(BaseModel):
    """The fields of Anthropic's Messages request that agentrl reads; others are ignored."""

    model_config = ConfigDict(extra="allow")

    model: str = ""
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content or [] if b.get("type") == "text")


def to_chat_request(req: MessagesRequest) -> ChatRequest:
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text(req.system)})
    for m in req.messages:
        messages.extend(_to_openai(m))
    tools = [
        {"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                          "parameters": t.get("input_schema", {})}}
        for t in req.tools or []
    ]  # fmt: skip
    return ChatRequest(
        messages=messages, tools=tools or None, max_tokens=req.max_tokens, stop=req.stop_sequences
    )


def _to_openai(message: dict[str, Any]) -> list[dict[str, Any]]:
    """One Anthropic message -> OpenAI messages (a user turn of tool results -> tool messages)."""
    role, content = message["role"], message.get("content", "")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if role == "assistant":
        calls = [
            {"id": b["id"], "type": "function",
             "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}}
            for b in content if b.get("type") == "tool_use"
        ]  # fmt: skip
        out: dict[str, Any] = {"role": "assistant", "content": _text(content)}
        return [{**out, "tool_calls": calls} if calls else out]
    results = [
        {"role": "tool", "tool_call_id": b["tool_use_id"], "content": _text(b.get("content", ""))}
        for b in content
        if b.get("type") == "tool_result"
    ]
    text = _text(content)
    return results + ([{"role": "user", "content": text}] if text or not results else [])


def to_messages_response(response: dict[str, Any], model: str) -> dict[str, Any]:
    """An OpenAI chat response (its first choice) as an Anthropic Message."""
    choice = response["choices"][0]
    message = choice["message"]
    blocks: list[dict[str, Any]] = []
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        try:
            args = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            args = {"_raw": fn["arguments"]}  # malformed by the model: shown, not dropped
        blocks.append({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": args})
    stop = {"length": "max_tokens", "tool_calls": "tool_use"}.get(
        choice["finish_reason"], "end_turn"
    )
    usage = response["usage"]
    return {
        "id": response["id"].replace("chatcmpl-", "msg_"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "output_tokens": usage["completion_tokens"],
        },
        "metadata": response["metadata"],
    }
