"""`Tool` and the `@tool` decorator: a typed function plus its schema and its limits."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import pkgutil
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, overload

import pydantic

from agentrl.tools.schema import (
    ArgumentError,
    argument_error,
    build_args_model,
    is_optional,
    json_schema,
    parse_docstring,
    resolve_hints,
)


class ConcurrencyLimit:
    """At most `max_concurrency` calls at once (of a tool, shared by every registry holding it;
    of a runner's episodes).

    asyncio semaphores belong to one event loop, so one is made per loop (tests and Ray
    workers run several loops over the life of a process).
    """

    def __init__(self, max_concurrency: int | None) -> None:
        self.max_concurrency = max_concurrency
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    def __getstate__(self) -> dict[str, Any]:  # semaphores stay behind; each process makes its own
        return {"max_concurrency": self.max_concurrency}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["max_concurrency"])

    def held(self) -> contextlib.AbstractAsyncContextManager[Any]:
        """One of the slots, for an `async with` block (at once where there is no limit)."""
        if self.max_concurrency is None:
            return contextlib.nullcontext()
        loop = asyncio.get_running_loop()
        sem = self._by_loop.get(loop)
        if sem is None:
            sem = self._by_loop[loop] = asyncio.Semaphore(self.max_concurrency)
        return sem


@dataclass(eq=False)
class Tool:
    """A function the model may call. Calling the Tool calls the function directly."""

    fn: Callable[..., Any]
    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments (an object)."""
    args_model: type[pydantic.BaseModel] | None = field(default=None, repr=False)
    """Validates the arguments; made at run time, so rebuilt from `fn` after unpickling."""
    fills_none: tuple[str, ...] = ()
    """Parameters `x: T | None` without a default: passed as None when left out."""
    timeout_s: float | None = 30.0
    """Seconds before a call becomes a timeout observation; None = no limit."""
    max_concurrency: int | None = None
    """Most simultaneous calls of this tool, across every env instance in the process."""
    max_output_tokens: int | None = None
    """Overrides the registry's output cap for this tool."""
    is_method: bool = False
    """Defined in a class body with `self` first: bound to the instance on attribute access."""
    limit: ConcurrencyLimit = field(default_factory=lambda: ConcurrencyLimit(None), repr=False)

    def __post_init__(self) -> None:
        if self.limit.max_concurrency != self.max_concurrency:
            self.limit = ConcurrencyLimit(self.max_concurrency)

    @property
    def is_async(self) -> bool:
        fn = self.fn.func if isinstance(self.fn, functools.partial) else self.fn
        if inspect.isroutine(fn):
            return inspect.iscoroutinefunction(fn)
        return inspect.iscoroutinefunction(type(fn).__call__)  # a callable object

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "args_model": None}

    def __reduce__(self) -> Any:
        """A module-level tool pickles by reference (its name now points at the Tool, not the
        function), so a process that unpickles an env shares that module's limits."""
        name = f"{getattr(self.fn, '__module__', None)}:{getattr(self.fn, '__qualname__', '')}"
        with contextlib.suppress(ImportError, AttributeError, ValueError):  # no name reaches it
            if pkgutil.resolve_name(name) is self:
                return pkgutil.resolve_name, (name,)
        owner = getattr(self.fn, "__self__", None)
        attr = getattr(self.fn, "__name__", "")
        if owner is not None and isinstance(inspect.getattr_static(type(owner), attr, None), Tool):
            return getattr, (owner, attr)  # `@tool` on a method: re-bind on the unpickled owner
        return super().__reduce__()

    def __get__(self, obj: Any, objtype: type | None = None) -> Tool:
        """`@tool` on a method: `instance.method` is a Tool bound to the instance (same limits)."""
        if obj is None or not self.is_method:
            return self
        return replace(self, fn=self.fn.__get__(obj, objtype), limit=self.limit)

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-calling entry for this tool."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def bind(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Validated keyword arguments for `fn`, or ArgumentError naming what is wrong.

        Validated as JSON, where the arguments came from: an object fills a dataclass, a
        string an Enum, and nothing is coerced across JSON types but integer to number.
        """
        if self.args_model is None:
            self.args_model = _signature_model(self.fn, self.name)[0]
        try:
            model = self.args_model.model_validate_json(json.dumps(arguments))
        except pydantic.ValidationError as e:
            raise argument_error(e, self.parameters) from None
        fields = type(model).model_fields
        kwargs = {
            fields[n].alias or n: getattr(model, n) for n in model.model_fields_set if n in fields
        }
        kwargs.update({name: None for name in self.fills_none if name not in kwargs})
        return {**kwargs, **(model.model_extra or {})}

    async def run(self, kwargs: dict[str, Any]) -> Any:
        """Call the function; a sync one runs in a worker thread so it never blocks the loop."""
        if self.is_async:
            return await self.fn(**kwargs)
        result = await asyncio.to_thread(self.fn, **kwargs)
        if inspect.isawaitable(result):  # a plain def that returns a coroutine
            result = await result
        return result


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...
@overload
def tool(
    *,
    name: str | None = None,
    timeout_s: float | None = 30.0,
    max_concurrency: int | None = None,
    max_output_tokens: int | None = None,
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    timeout_s: float | None = 30.0,
    max_concurrency: int | None = None,
    max_output_tokens: int | None = None,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Make a function a tool: its schema comes from the type hints and the docstring.

    The docstring's text before the first section is the tool's description; an `Args:`
    (Google) or `Parameters` (numpy) section describes each parameter. Usable bare
    (`@tool`) or with limits (`@tool(timeout_s=5, max_concurrency=4)`), on functions,
    async functions and methods. A Tool is returned as it is.
    """
    if fn is None:  # @tool(...): the decorator (pyright cannot type a partial of an overload)
        return functools.partial(  # pyright: ignore[reportReturnType]
            tool,
            name=name,
            timeout_s=timeout_s,
            max_concurrency=max_concurrency,
            max_output_tokens=max_output_tokens,
        )
    if isinstance(fn, Tool):
        return fn
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(
            f"max_concurrency={max_concurrency} for tool {name or fn!r}: use an int >= 1 or None"
        )
    target = fn.func if isinstance(fn, functools.partial) else fn
    tool_name = name or getattr(target, "__name__", None)
    if not tool_name or tool_name == "<lambda>":
        raise ValueError(f"cannot name the tool {fn!r}: pass @tool(name=...)")
    description = parse_docstring(inspect.getdoc(target) or "")[0]
    model, fills_none = _signature_model(fn, tool_name)
    return Tool(
        fn=fn,
        name=tool_name,
        description=description or tool_name,
        parameters=json_schema(model),
        args_model=model,
        fills_none=fills_none,
        timeout_s=timeout_s,
        max_concurrency=max_concurrency,
        max_output_tokens=max_output_tokens,
        is_method=_is_unbound_method(fn),
    )


def _is_unbound_method(fn: Callable[..., Any]) -> bool:
    """`@tool` on a method in a class body sees a plain function whose first parameter is self."""
    if not inspect.isfunction(fn):
        return False
    first = next(iter(inspect.signature(fn).parameters), None)
    return first in ("self", "cls")


def _signature_model(
    fn: Callable[..., Any], tool_name: str
) -> tuple[type[pydantic.BaseModel], tuple[str, ...]]:
    """The arguments model of `fn` (`**kwargs`: extra arguments pass unchecked) and its
    `x: T | None` parameters without a default."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    hints = resolve_hints(target) if inspect.isfunction(target) or inspect.ismethod(target) else {}
    docs = parse_docstring(inspect.getdoc(target) or "")[1]
    params: list[tuple[str, Any, Any, str | None]] = []
    fills_none: list[str] = []
    accepts_extra = False
    for i, p in enumerate(inspect.signature(fn).parameters.values()):
        if i == 0 and _is_unbound_method(fn):
            continue  # the instance is bound later, on attribute access
        if p.kind is p.VAR_KEYWORD:
            accepts_extra = True
            continue
        if p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY):
            raise TypeError(f"tool {tool_name!r}: parameter {p.name!r} must be passable by keyword")
        annotation = hints.get(p.name, Any)
        default = p.default
        if default is p.empty:
            default = None if is_optional(annotation) else ...
            if default is None:
                fills_none.append(p.name)
        params.append((p.name, annotation, default, docs.get(p.name)))
    model = build_args_model(tool_name, params, accepts_extra=accepts_extra)
    return model, tuple(fills_none)


__all__ = ["ArgumentError", "Tool", "tool"]
