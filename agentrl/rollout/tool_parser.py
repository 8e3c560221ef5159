"""Tool-call parsing from sampled text: Hermes/Qwen `<tool_call>{json}</tool_call>` blocks and
Search-R1-style `<name>argument</name>` tags. Pure functions; nothing here raises on model output."""

from __future__ import annotations

import json
import re
from typing import Any

from agentrl.types import Message, ToolCall

_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_NAME_RE = re.compile(r'"name"\s*:\s*"([^"]*)"')


def parse_hermes(text: str) -> Message:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (any number) become
    ToolCalls; the remaining text is the content. An unclosed block (the turn hit its token
    limit) or malformed JSON still becomes a ToolCall, so the registry answers it as an error."""
    calls = [_hermes_call(m.group(1), index=i) for i, m in enumerate(_TOOL_CALL_RE.finditer(text))]
    content = _TOOL_CALL_RE.sub("", text).strip() if calls else text.strip()
    return Message(role="assistant", content=content, tool_calls=calls)


def _hermes_call(block: str, *, index: int) -> ToolCall:
    raw = block.strip()
    call_id = f"call_{index}"
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        # Malformed: keep the raw text as arguments so the registry's error quotes it back.
        match = _NAME_RE.search(raw)
        return ToolCall(name=match.group(1) if match else "", arguments=raw, id=call_id)
    args: Any = obj.get("arguments", obj.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(name=obj["name"], arguments=arguments, id=call_id)


def tag_parameters(tools: list[dict[str, Any]] | None) -> dict[str, str]:
    """Tool name -> its (first) string parameter, for tools callable as `<name>arg</name>`."""
    out: dict[str, str] = {}
    for schema in tools or []:
        fn = schema.get("function", schema)
        params = (fn.get("parameters") or {}).get("properties") or {}
        required = (fn.get("parameters") or {}).get("required") or list(params)
        if fn.get("name") and required:
            out[fn["name"]] = required[0]
    return out


def parse_tags(text: str, parameters: dict[str, str]) -> Message:
    """Search-R1-style actions: each `<name>argument</name>` for a known tool name becomes a
    ToolCall with arguments `{"<param>": "argument"}`. The text (with `<answer>`) is the content."""
    calls: list[ToolCall] = []
    if parameters:
        names = "|".join(re.escape(n) for n in parameters)
        pattern = re.compile(rf"<({names})>(.*?)</\1>", re.DOTALL)
        for i, m in enumerate(pattern.finditer(text)):
            args = json.dumps({parameters[m.group(1)]: m.group(2).strip()}, ensure_ascii=False)
            calls.append(ToolCall(name=m.group(1), arguments=args, id=f"call_{i}"))
    return Message(role="assistant", content=text.strip(), tool_calls=calls)
