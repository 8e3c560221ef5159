"""`Tool` objects: direct calls, methods, pickling (envs cross process boundaries in Ray)."""

from __future__ import annotations

import pickle

from agentrl.tools import Tool, ToolRegistry, tool
from agentrl.types import ToolCall


@tool(max_concurrency=3)
def shout(text: str) -> str:
    """Upper-case the text."""
    return text.upper()


class Counter:
    def __init__(self, step: int) -> None:
        self.step = step
        self.tools = ToolRegistry([self.add])

    @tool(max_concurrency=2)
    async def add(self, x: int) -> int:
        return x + self.step


def test_decorated_function_stays_callable() -> None:
    assert isinstance(shout, Tool)
    assert shout("hi") == "HI"
    assert shout.description == "Upper-case the text." and shout.max_concurrency == 3


def test_module_level_tool_pickles_by_reference() -> None:
    assert pickle.loads(pickle.dumps(shout)) is shout


async def test_method_tool_pickles_bound_to_the_unpickled_owner() -> None:
    original = Counter(step=10)
    copy = pickle.loads(pickle.dumps(original))
    copy.step = 100
    result = await copy.tools.call(ToolCall("add", '{"x": 1}', "c"))
    assert result.content == "101"
    assert copy.tools["add"].limit is Counter.add.limit  # one concurrency limit per process
    assert (await original.tools.call(ToolCall("add", '{"x": 1}', "c"))).content == "11"


def test_function_tool_stored_on_a_class_is_not_bound() -> None:
    class Env:
        loud = shout  # a plain-function tool kept as a class attribute

    assert Env().loud is shout and Env().loud("a") == "A"
