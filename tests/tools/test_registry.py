"""`ToolRegistry.call`: every failure becomes an observation, limits hold, output is capped."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time

import pytest

from agentrl.tools import ToolRegistry, ToolResult, tool
from agentrl.types import ToolCall


@dataclasses.dataclass
class Item:
    name: str
    price: float


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def scale(x: float, factor: float = 2.0) -> float:
    return x * factor


@tool
def total(items: list[Item]) -> dict:
    return {"total": sum(i.price for i in items), "names": [i.name for i in items]}


@tool
def boom(message: str) -> str:
    raise RuntimeError(message)


@tool
def leave() -> str:
    raise SystemExit(3)


@tool(timeout_s=0.2)
async def slow_async() -> str:
    await asyncio.sleep(10)
    return "never"


@tool(timeout_s=0.2)
def slow_sync() -> str:
    time.sleep(1.0)
    return "never"


@tool
async def echo(text: str) -> str:
    return text


def registry() -> ToolRegistry:
    return ToolRegistry([add, scale, total, boom, leave, slow_async, slow_sync, echo])


async def call(reg: ToolRegistry, name: str, arguments: str, call_id: str = "c1") -> ToolResult:
    return await reg.call(ToolCall(name=name, arguments=arguments, id=call_id))


async def test_success_returns_tool_message_with_json_for_non_strings() -> None:
    reg = registry()
    r = await call(reg, "add", '{"a": 2, "b": 3}', "call_7")
    assert not r.is_error and r.error_kind is None
    assert (r.message.role, r.message.content, r.message.tool_call_id, r.message.name) == (
        "tool",
        "5",
        "call_7",
        "add",
    )
    r = await call(
        reg, "total", '{"items": [{"name": "a", "price": 1}, {"name": "b", "price": 2.5}]}'
    )
    assert json.loads(r.content) == {"total": 3.5, "names": ["a", "b"]}
    assert (await call(reg, "echo", '{"text": "hi"}')).content == "hi"


async def test_int_is_coerced_to_float() -> None:
    r = await call(registry(), "scale", '{"x": 3}')
    assert r.content == "6.0"


FAILURES = [
    ("add", '{"a": 1, "b": ', "malformed_json", ["malformed JSON", "Expecting value"]),
    ("add", "[1, 2]", "malformed_json", ["must be a JSON object", "list"]),
    ("nope", "{}", "unknown_tool", ["unknown tool 'nope'", "add", "echo"]),
    ("add", '{"a": 1}', "invalid_arguments", ["missing required argument 'b'", "integer"]),
    ("add", '{"a": 1, "b": 2, "c": 3}', "invalid_arguments", ["unexpected argument 'c'", "a, b"]),
    (
        "add",
        '{"a": "one", "b": 2}',
        "invalid_arguments",
        ["'a'", "must be integer", 'string "one"'],
    ),
    ("add", '{"a": 1.5, "b": 2}', "invalid_arguments", ["'a'", "must be integer"]),
    ("add", '{"a": true, "b": 2}', "invalid_arguments", ["'a'", "boolean"]),
    ("total", '{"items": [{"name": "a"}]}', "invalid_arguments", ["'items[0].price'", "number"]),
    (
        "total",
        '{"items": [{"name": "a", "price": "x"}]}',
        "invalid_arguments",
        ["'items[0].price' must be number"],
    ),
    ("boom", '{"message": "kaput"}', "exception", ["Error: RuntimeError: kaput"]),
    ("leave", "", "exception", ["SystemExit"]),
    ("slow_async", "{}", "timeout", ["timed out after 0.2 s"]),
    ("slow_sync", "{}", "timeout", ["timed out after 0.2 s"]),
]


@pytest.mark.parametrize(
    ("name", "arguments", "kind", "fragments"), FAILURES, ids=[f[2] + ":" + f[0] for f in FAILURES]
)
async def test_every_failure_is_an_observation_and_registry_stays_usable(
    name, arguments, kind, fragments
) -> None:
    reg = registry()
    r = await call(reg, name, arguments, "call_9")
    assert r.is_error and r.error_kind == kind
    assert r.message.role == "tool" and r.message.tool_call_id == "call_9"
    assert r.content.startswith("Error")
    for fragment in fragments:
        assert fragment in r.content
    assert (await call(reg, "add", '{"a": 1, "b": 1}')).content == "2"


async def test_empty_arguments_mean_no_arguments() -> None:
    reg = ToolRegistry()

    @reg.register
    @tool
    def ping() -> str:
        return "pong"

    assert (await call(reg, "ping", "")).content == "pong"


async def test_optional_argument_without_default_may_be_left_out() -> None:
    @tool
    def greet(name: str, title: str | None) -> str:
        return f"{title or ''}{name}"

    reg = ToolRegistry([greet])
    assert (await call(reg, "greet", '{"name": "Ada"}')).content == "Ada"
    assert (await call(reg, "greet", '{"name": "Ada", "title": null}')).content == "Ada"
    r = await call(reg, "greet", '{"name": "Ada", "title": 3}')
    assert r.error_kind == "invalid_arguments" and "'title' must be string" in r.content


async def test_sync_tool_does_not_block_the_event_loop() -> None:
    @tool(timeout_s=5)
    def blocking() -> str:
        time.sleep(0.3)
        return "done"

    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        for _ in range(5):
            await asyncio.sleep(0.02)
            ticks += 1

    reg = ToolRegistry([blocking])
    result, _ = await asyncio.gather(call(reg, "blocking", "{}"), ticker())
    assert result.content == "done"
    assert ticks == 5  # the ticker ran while the tool slept in its thread


async def test_concurrency_limit_is_honoured_across_registries() -> None:
    active = max_active = 0

    @tool(max_concurrency=2)
    async def work() -> str:
        nonlocal active, max_active
        active += 1
        max_active = max(max_active, active)
        await asyncio.sleep(0.02)
        active -= 1
        return "ok"

    registries = [ToolRegistry([work]) for _ in range(3)]  # one per env instance, one shared limit
    results = await asyncio.gather(*(call(registries[i % 3], "work", "{}") for i in range(12)))
    assert all(r.content == "ok" for r in results)
    assert max_active == 2


async def test_concurrency_limit_applies_to_sync_tools() -> None:
    lock = threading.Lock()
    active = max_active = 0

    @tool(max_concurrency=1)
    def work() -> str:
        nonlocal active, max_active
        with lock:
            active += 1
            max_active = max(max_active, active)
        time.sleep(0.02)
        with lock:
            active -= 1
        return "ok"

    reg = ToolRegistry([work])
    await asyncio.gather(*(call(reg, "work", "{}") for _ in range(4)))
    assert max_active == 1


async def test_cancellation_propagates() -> None:
    reg = registry()
    task = asyncio.ensure_future(call(reg, "echo", '{"text": "x"}'))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


class WordTokenizer:
    """One token per space-separated word: enough to count what truncation keeps."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[str]:
        return text.split(" ")

    def decode(self, ids: list[str]) -> str:
        return " ".join(ids)


async def test_long_output_keeps_head_and_tail_in_tokens() -> None:
    words = " ".join(f"w{i}" for i in range(1000))
    reg = ToolRegistry([echo], max_output_tokens=100)
    reg.tokenizer = WordTokenizer()
    text = (await call(reg, "echo", json.dumps({"text": words}))).content
    assert text.startswith("w0 w1 w2") and text.endswith("w998 w999")
    kept = [w for w in text.split() if w.startswith("w")]
    assert len(kept) <= 100
    assert f"[... {1000 - len(kept)} tokens truncated ...]" in text


async def test_long_output_without_tokenizer_cuts_characters() -> None:
    reg = ToolRegistry([echo], max_output_tokens=50)  # about 200 characters
    text = (await call(reg, "echo", json.dumps({"text": "a" * 500 + "b" * 500}))).content
    assert text.startswith("aaa") and text.endswith("bbb")
    assert len(text) < 260
    assert "characters truncated" in text


async def test_tool_cap_overrides_registry_cap() -> None:
    @tool(max_output_tokens=10)
    def big() -> str:
        return "x" * 1000

    reg = ToolRegistry([big], max_output_tokens=None)
    assert len((await call(reg, "big", "")).content) < 100
    assert (
        await call(
            ToolRegistry([echo], max_output_tokens=None), "echo", json.dumps({"text": "y" * 9000})
        )
    ).content == "y" * 9000


def test_schemas_in_registration_order_and_duplicate_names_rejected() -> None:
    reg = ToolRegistry([add, echo])
    assert [s["function"]["name"] for s in reg.schemas()] == ["add", "echo"]
    assert "add" in reg and len(reg) == 2
    reg.register(add)  # the same tool again is a no-op

    @tool(name="add")
    def other(x: int) -> int:
        return x

    with pytest.raises(ValueError, match="already registered"):
        reg.register(other)


async def test_var_keyword_tool_accepts_extra_arguments_but_checks_its_own() -> None:
    @tool
    def tag(name: str, **labels: str) -> dict:
        return {"name": name, **labels}

    reg = ToolRegistry([tag])
    assert tag.parameters["additionalProperties"] is True
    assert json.loads((await call(reg, "tag", '{"name": "a", "color": "red"}')).content) == {
        "name": "a",
        "color": "red",
    }
    r = await call(reg, "tag", '{"color": "red"}')
    assert (
        r.error_kind == "invalid_arguments"
        and "missing required argument 'name' (string)" in r.content
    )
