"""The Anthropic Messages shape (`POST /v1/messages`) over the same capture as chat
completions: requests become OpenAI-style messages (tool_use -> tool_calls, tool_result ->
role "tool"), replies become content blocks, so an agent on either API records the same way."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agentrl.rollout.agent_endpoint.chat import ChatRequest


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


def to_chat_request(req: MessagesRequest) -> ChatRequest:
    """The chat request `req` asks for; ValueError naming the field the Messages API would
    refuse (a role, a block without its `type`, a tool_use without its `id`...)."""
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text(req.system, "system")})
    for i, m in enumerate(req.messages):
        messages.extend(_to_openai(m, f"messages[{i}]"))
    tools = [_tool(t, f"tools[{i}]") for i, t in enumerate(req.tools or [])]
    return ChatRequest.model_validate(
        {
            "messages": messages,
            "tools": tools or None,
            "max_tokens": req.max_tokens,
            "stop": req.stop_sequences,
        }
    )


def _tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    function = {
        "name": _field(tool, "name", str, where),
        "description": tool.get("description", ""),
        "parameters": tool.get("input_schema", {}),
    }
    return {"type": "function", "function": function}


def _field(block: dict[str, Any], key: str, kind: type, where: str) -> Any:
    value = block.get(key)
    if not isinstance(value, kind):
        raise ValueError(f"{where}.{key}: give a {kind.__name__}, not {value!r:.60}")
    return value


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """`content` as a list of content blocks, each with its `type`."""
    if not isinstance(content, list):
        raise ValueError(f"{where}: give a string or a list of content blocks, not {content!r:.60}")
    for j, block in enumerate(content):
        if not isinstance(block, dict):
            raise ValueError(f"{where}[{j}]: give a content block object, not {block!r:.60}")
        _field(block, "type", str, f"{where}[{j}]")
    return content


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    blocks = _blocks(content, where)
    return "".join(
        _field(b, "text", str, f"{where}[{j}]") for j, b in enumerate(blocks) if b["type"] == "text"
    )


def _to_openai(message: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """One Anthropic message -> OpenAI messages (a user turn of tool results -> tool messages)."""
    role = message.get("role")
    content = message.get("content", "")
    if role not in ("user", "assistant"):
        raise ValueError(
            f"{where}.role: {role!r} is not 'user' or 'assistant' (the system prompt goes in `system`)"
        )
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    blocks = _blocks(content, f"{where}.content")
    text = _text(content, f"{where}.content")
    if role == "assistant":
        calls = [
            _tool_call(b, f"{where}.content[{j}]")
            for j, b in enumerate(blocks)
            if b["type"] == "tool_use"
        ]
        out: dict[str, Any] = {"role": "assistant", "content": text}
        return [{**out, "tool_calls": calls} if calls else out]
    results = [
        _tool_result(b, f"{where}.content[{j}]")
        for j, b in enumerate(blocks)
        if b["type"] == "tool_result"
    ]
    return results + ([{"role": "user", "content": text}] if text or not results else [])


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = _field(block, "tool_use_id", str, where)
    return {
        "role": "tool",
        "tool_call_id": call_id,
        "content": _text(block.get("content", ""), f"{where}.content"),
    }


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise ValueError(
            f"{where}.input: give the tool's arguments as an object, not {arguments!r:.60}"
        )
    return {
        "id": _field(block, "id", str, where),
        "type": "function",
        "function": {"name": _field(block, "name", str, where), "arguments": json.dumps(arguments)},
    }


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
