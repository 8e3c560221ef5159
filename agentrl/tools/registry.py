"""`ToolRegistry`: the tools one env offers, and `call()`, which turns every failure into a
tool message the model reads instead of an exception."""

from __future__ import annotations

import asyncio
import enum
import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from agentrl.tools.output import TextTokenizer, format_output, truncate_middle
from agentrl.tools.tool import ArgumentError, Tool, tool
from agentrl.types import Message, ToolCall


class ToolErrorKind(str, enum.Enum):
    """Why a tool call failed; a str, so `result.error_kind == "timeout"` works."""

    UNKNOWN_TOOL = "unknown_tool"
    MALFORMED_JSON = "malformed_json"
    INVALID_ARGUMENTS = "invalid_arguments"
    EXCEPTION = "exception"
    TIMEOUT = "timeout"


@dataclass
class ToolResult:
    """The reply to one tool call: a `role="tool"` message, plus what happened."""

    message: Message
    is_error: bool = False
    error_kind: str | None = None
    """A ToolErrorKind value when is_error."""
    elapsed_s: float = 0.0

    @property
    def content(self) -> str:
        return self.message.content


@dataclass
class _Failure:
    """A tool's own exception, carried out of the timed section so it is not mistaken for ours."""

    error: BaseException


class ToolRegistry:
    """Named tools with their schemas. `call()` never raises on anything a model writes."""

    def __init__(
        self,
        tools: Iterable[Tool | Callable[..., Any]] | None = None,
        *,
        max_output_tokens: int | None = 1024,
    ) -> None:
        self._tools: dict[str, Tool] = {}
        self.max_output_tokens = max_output_tokens
        """Default cap on one tool reply, in tokens (None = no cap); a tool may set its own."""
        self.tokenizer: TextTokenizer | None = None
        """Counts output tokens exactly: the runner binds its chat codec here before `reset`."""
        for t in tools or ():
            self.register(t)

    def register(self, fn_or_tool: Tool | Callable[..., Any]) -> Tool:
        """Add a Tool, or a plain function made into one with default limits."""
        t = tool(fn_or_tool)
        if t.name in self._tools and self._tools[t.name] is not t:
            raise ValueError(
                f"a tool named {t.name!r} is already registered; pass @tool(name=...) to rename one"
            )
        self._tools[t.name] = t
        return t

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """OpenAI `tools=` entries, in registration order (what the chat template renders)."""
        return [t.schema() for t in self._tools.values()]

    async def call(self, call: ToolCall) -> ToolResult:
        """Run one tool call. Unknown tools, bad JSON, bad arguments, exceptions and timeouts
        all come back as error observations; only cancellation propagates."""
        start = time.perf_counter()
        t = self._tools.get(call.name)
        if t is None:
            known = ", ".join(self._tools) or "none"
            return self._error(
                call,
                start,
                ToolErrorKind.UNKNOWN_TOOL,
                f"Error: unknown tool {call.name!r}. Available tools: {known}.",
            )
        try:
            kwargs = t.bind(self._decode(call))
        except _DecodeError as e:
            return self._error(call, start, ToolErrorKind.MALFORMED_JSON, f"Error: {e}")
        except ArgumentError as e:
            text = f"Error: invalid arguments for tool {t.name!r}: {e}."
            return self._error(call, start, ToolErrorKind.INVALID_ARGUMENTS, text)
        except Exception as e:  # e.g. a pydantic validator that raises something unexpected
            return self._error(call, start, ToolErrorKind.INVALID_ARGUMENTS, _raised(e))
        return await self._invoke(t, call, kwargs, start)

    async def _invoke(
        self, t: Tool, call: ToolCall, kwargs: dict[str, Any], start: float
    ) -> ToolResult:
        async with t.limit.held():
            try:
                outcome = await asyncio.wait_for(_guarded(t, kwargs), timeout=t.timeout_s)
            except asyncio.TimeoutError:
                text = f"Error: tool {t.name!r} timed out after {t.timeout_s:g} s."
                return self._error(call, start, ToolErrorKind.TIMEOUT, text)
        if isinstance(outcome, _Failure):
            return self._error(call, start, ToolErrorKind.EXCEPTION, _raised(outcome.error))
        try:
            text = format_output(outcome)
        except Exception as e:
            return self._error(call, start, ToolErrorKind.EXCEPTION, _raised(e))
        return ToolResult(
            self._message(call, self._cap(t, text)), elapsed_s=time.perf_counter() - start
        )

    def _decode(self, call: ToolCall) -> dict[str, Any]:
        raw = call.arguments
        if isinstance(raw, dict):
            return raw
        if raw is None or not str(raw).strip():
            return {}  # models often send "" for a tool without arguments
        try:
            value = json.loads(raw)
        except (json.JSONDecodeError, TypeError) as e:
            raise _DecodeError(
                f"malformed JSON arguments for tool {call.name!r}: {e}. Arguments must be a JSON object."
            ) from None
        if not isinstance(value, dict):
            raise _DecodeError(
                f"arguments for tool {call.name!r} must be a JSON object, got {type(value).__name__}: {raw[:80]}"
            )
        return value

    def _cap(self, t: Tool, text: str) -> str:
        max_tokens = (
            t.max_output_tokens if t.max_output_tokens is not None else self.max_output_tokens
        )
        try:
            return truncate_middle(text, max_tokens, self.tokenizer)
        except Exception:  # a tokenizer that cannot encode this text: fall back to characters
            return truncate_middle(text, max_tokens)

    def _message(self, call: ToolCall, text: str) -> Message:
        return Message(role="tool", content=text, tool_call_id=call.id or None, name=call.name)

    def _error(self, call: ToolCall, start: float, kind: ToolErrorKind, text: str) -> ToolResult:
        message = self._message(call, truncate_middle(text, self.max_output_tokens))
        return ToolResult(
            message, is_error=True, error_kind=kind.value, elapsed_s=time.perf_counter() - start
        )


class _DecodeError(ValueError):
    pass


async def _guarded(t: Tool, kwargs: dict[str, Any]) -> Any:
    try:
        return await t.run(kwargs)
    except (Exception, SystemExit) as e:  # a tool that calls sys.exit must not end the run
        return _Failure(e)


def _raised(e: BaseException) -> str:
    return f"Error: {type(e).__name__}: {e}"
