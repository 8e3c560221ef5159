"""Typed tools for agents: `@tool` derives the schema, `ToolRegistry.call` turns every failure
into an observation. Sandboxed code execution lives in `agentrl.tools.sandbox`."""

from __future__ import annotations

from agentrl.tools.registry import ToolErrorKind, ToolRegistry, ToolResult
from agentrl.tools.tool import ArgumentError, Tool, tool

__all__ = ["ArgumentError", "Tool", "ToolErrorKind", "ToolRegistry", "ToolResult", "tool"]
