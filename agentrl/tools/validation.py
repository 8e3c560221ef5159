"""Checks decoded JSON arguments against type hints and builds the typed values a tool expects."""

from __future__ import annotations

import dataclasses
import enum
import json
import typing
from typing import Any, Literal

from agentrl.tools.schema import is_pydantic_model, is_union, resolve_hints, strip_annotated


class ArgumentError(ValueError):
    """An argument the model wrote does not fit the tool's signature; the text is shown to it."""


def describe(tp: Any) -> str:
    """A type in the words of JSON schema, for error messages the model reads."""
    tp, _ = strip_annotated(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    names = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null"}
    if tp in names:
        return names[tp]
    if tp is Any:
        return "any value"
    if is_union(tp):
        return " or ".join(describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(json.dumps(a) for a in args)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(json.dumps(m.value) for m in tp)
    if tp in (list, tuple, set, frozenset) or origin in (
        list,
        tuple,
        set,
        frozenset,
        typing.Sequence,
    ):
        return f"array of {describe(args[0])}" if args else "array"
    if (
        dataclasses.is_dataclass(tp)
        or is_pydantic_model(tp)
        or tp is dict
        or origin in (dict, typing.Mapping)
    ):
        return f"object ({tp.__name__})" if isinstance(tp, type) and tp is not dict else "object"
    return getattr(tp, "__name__", str(tp))


def _got(value: Any) -> str:
    kind = {
        str: "string",
        bool: "boolean",
        int: "integer",
        float: "number",
        list: "array",
        dict: "object",
    }
    text = json.dumps(value, default=str)
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"{kind.get(type(value), 'null' if value is None else type(value).__name__)} {text}"


def _fail(path: str, tp: Any, value: Any) -> ArgumentError:
    return ArgumentError(f"argument '{path}' must be {describe(tp)}, got {_got(value)}")


def coerce(value: Any, tp: Any, path: str) -> Any:
    """Return `value` as type `tp` (int -> float, dict -> dataclass...) or raise ArgumentError."""
    tp, _ = strip_annotated(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any or tp is object:
        return value
    if is_union(tp):
        return _coerce_union(value, tp, args, path)
    if tp is type(None):
        if value is None:
            return None
        raise _fail(path, tp, value)
    if tp in (str, bool, int, float):
        return _coerce_primitive(value, tp, path)
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise _fail(path, tp, value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        for member in tp:
            if value == member.value and type(value) is type(member.value):
                return member
        raise _fail(path, tp, value)
    if tp in (list, tuple, set, frozenset) or origin in (
        list,
        tuple,
        set,
        frozenset,
        typing.Sequence,
    ):
        return _coerce_array(value, tp, origin or tp, args, path)
    if tp is dict or origin in (dict, typing.Mapping):
        if not isinstance(value, dict):
            raise _fail(path, tp, value)
        if len(args) == 2:
            return {k: coerce(v, args[1], f"{path}.{k}") for k, v in value.items()}
        return value
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _coerce_dataclass(value, tp, path)
    if is_pydantic_model(tp):
        return _coerce_pydantic(value, tp, path)
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise _fail(path, tp, value)


def _coerce_primitive(value: Any, tp: type, path: str) -> Any:
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, tp) and not (tp is not bool and isinstance(value, bool)):
        return value
    raise _fail(path, tp, value)


def _coerce_union(value: Any, tp: Any, args: tuple[Any, ...], path: str) -> Any:
    if value is None:
        if type(None) in args:
            return None
        raise _fail(path, tp, value)
    # Exact matches first, so 3 stays an int under `float | int` and "1" stays a string.
    for arm in args:
        base, _ = strip_annotated(arm)
        if base in (str, bool, int, float) and type(value) is base:
            return value
    errors = []
    for arm in (a for a in args if a is not type(None)):
        try:
            return coerce(value, arm, path)
        except ArgumentError as e:
            errors.append(e)
    if len(errors) == 1:  # Optional[X]: X's own message is the precise one
        raise errors[0]
    raise _fail(path, tp, value)


def _coerce_array(value: Any, tp: Any, container: Any, args: tuple[Any, ...], path: str) -> Any:
    if not isinstance(value, list):
        raise _fail(path, tp, value)
    if container is tuple and args and args[-1] is not Ellipsis:
        if len(value) != len(args):
            raise ArgumentError(
                f"argument '{path}' must be an array of {len(args)} items, got {len(value)}"
            )
        return tuple(
            coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True))
        )
    item_tp = args[0] if args else Any
    items = [coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    return items if container in (list, typing.Sequence) else container(items)


def _coerce_dataclass(value: Any, cls: type, path: str) -> Any:
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise _fail(path, cls, value)
    hints = resolve_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    required = [n for n, f in fields.items() if _is_required_field(f, hints[n])]
    check_keys(value, {n: hints[n] for n in fields}, path=path, required=required)
    kwargs = {name: coerce(v, hints[name], f"{path}.{name}") for name, v in value.items()}
    return cls(**kwargs)


def _is_required_field(f: dataclasses.Field, tp: Any) -> bool:
    has_default = (
        f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    )
    return not has_default and not (is_union(tp) and type(None) in typing.get_args(tp))


def _coerce_pydantic(value: Any, cls: type, path: str) -> Any:
    import pydantic

    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise _fail(path, cls, value)
    try:
        return cls.model_validate(value)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = ".".join([path, *(str(part) for part in first["loc"])])
        raise ArgumentError(
            f"argument '{where}': {first['msg']} (got {_got(first.get('input'))})"
        ) from None


def check_keys(
    value: dict[str, Any],
    known: dict[str, Any],
    *,
    path: str | None,
    required: list[str],
    allow_extra: bool = False,
) -> None:
    """Unknown or missing keys -> ArgumentError naming the key, its type, and the accepted keys.

    known: {name: annotation} of every accepted key.
    """
    prefix = f"{path}." if path else ""
    extra = [k for k in value if k not in known]
    if extra and not allow_extra:
        accepted = ", ".join(known) if known else "none"
        raise ArgumentError(
            f"unexpected argument '{prefix}{extra[0]}'; accepted arguments: {accepted}"
        )
    missing = [k for k in required if k not in value]
    if missing:
        name = missing[0]
        raise ArgumentError(f"missing required argument '{prefix}{name}' ({describe(known[name])})")
