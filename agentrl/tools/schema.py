"""JSON schema from Python type hints, and parameter descriptions from docstrings."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import re
import types
import typing
from typing import Any, Literal, Union

try:  # pydantic comes with fastapi; tools work without it
    import pydantic
except ImportError:  # pragma: no cover
    pydantic = None  # type: ignore[assignment]

_PRIMITIVES: dict[type, str] = {str: "string", bool: "boolean", int: "integer", float: "number"}
_SECTION = re.compile(
    r"^\s*(Args|Arguments|Parameters|Params|Returns?|Yields?|Raises|Examples?|Notes?|"
    r"Attributes|See Also|References|Warnings?)\s*:?\s*$"
)
_NUMPY_RULE = re.compile(r"^\s*-{3,}\s*$")
_PARAM_SECTIONS = ("Args", "Arguments", "Parameters", "Params", "Attributes")
_GOOGLE_PARAM = re.compile(r"^\s*\*{0,2}(\w+)\s*(?:\(([^)]*)\))?\s*:\s*(.*)$")
_NUMPY_PARAM = re.compile(r"^\s*(\w+)\s*(?::\s*(.*))?$")


def is_pydantic_model(tp: Any) -> bool:
    return pydantic is not None and isinstance(tp, type) and issubclass(tp, pydantic.BaseModel)


def is_optional(tp: Any) -> bool:
    return is_union(tp) and type(None) in typing.get_args(tp)


def strip_annotated(tp: Any) -> tuple[Any, str | None]:
    """`Annotated[X, "text"]` -> (X, "text"); anything else -> (tp, None)."""
    if typing.get_origin(tp) is typing.Annotated:
        base, *extras = typing.get_args(tp)
        text = next((e for e in extras if isinstance(e, str)), None)
        return base, text
    return tp, None


def is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def type_schema(tp: Any) -> dict[str, Any]:
    """The JSON schema of one annotation (OpenAI function-calling subset, no $ref)."""
    tp, text = strip_annotated(tp)
    schema = _type_schema(tp)
    if text:
        schema = {**schema, "description": text}
    return schema


def _type_schema(tp: Any) -> dict[str, Any]:
    if tp is Any or tp is inspect.Parameter.empty or tp is object:
        return {}
    if tp in _PRIMITIVES:
        return {"type": _PRIMITIVES[tp]}
    if tp is type(None):
        return {"type": "null"}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if is_union(tp):
        arms = [a for a in args if a is not type(None)]
        if len(arms) == 1:  # Optional[X]: not required, so X alone describes it
            return type_schema(arms[0])
        return {"anyOf": [type_schema(a) for a in arms]}
    if origin is Literal:
        return _enum_schema(list(args))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum_schema([m.value for m in tp])
    if tp in (list, tuple, set, frozenset) or origin in (
        list,
        tuple,
        set,
        frozenset,
        typing.Sequence,
    ):
        return _array_schema(origin or tp, args)
    if tp is dict or origin in (dict, typing.Mapping):
        schema: dict[str, Any] = {"type": "object"}
        if len(args) == 2 and args[1] is not Any:
            schema["additionalProperties"] = type_schema(args[1])
        return schema
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return dataclass_schema(tp)
    if is_pydantic_model(tp):
        return pydantic_schema(tp)
    raise TypeError(
        f"cannot derive a JSON schema for type {tp!r}; use str, int, float, bool, an Enum or "
        "Literal, list[...], dict, X | None, a dataclass or a pydantic model"
    )


def _enum_schema(values: list[Any]) -> dict[str, Any]:
    json_types = {_PRIMITIVES.get(type(v)) for v in values}
    schema: dict[str, Any] = {"enum": values}
    if len(json_types) == 1 and None not in json_types:
        schema = {"type": json_types.pop(), **schema}
    return schema


def _array_schema(container: Any, args: tuple[Any, ...]) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "array"}
    if container is tuple and args and args[-1] is not Ellipsis:
        schema["prefixItems"] = [type_schema(a) for a in args]
        schema["minItems"] = schema["maxItems"] = len(args)
    elif args:
        schema["items"] = type_schema(args[0])
    return schema


def object_schema(fields: list[tuple[str, Any, bool, Any, str | None]]) -> dict[str, Any]:
    """fields: (name, annotation, is_required, default, description)."""
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, annotation, is_required, default, description in fields:
        prop = type_schema(annotation)
        if description and "description" not in prop:
            prop["description"] = description
        if not is_required and _is_json_default(default):
            prop["default"] = default.value if isinstance(default, enum.Enum) else default
        properties[name] = prop
        if is_required:
            required.append(name)
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


def _is_json_default(value: Any) -> bool:
    if isinstance(value, enum.Enum):
        value = value.value
    return value is not None and isinstance(value, (str, int, float, bool))


def dataclass_schema(cls: type) -> dict[str, Any]:
    hints = resolve_hints(cls)
    docs = parse_docstring(cls.__doc__ or "")[1]
    fields = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        has_default = (
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        )
        default = f.default if f.default is not dataclasses.MISSING else None
        is_required = not has_default and not is_optional(hints[f.name])
        fields.append((f.name, hints[f.name], is_required, default, docs.get(f.name)))
    return object_schema(fields)


def pydantic_schema(cls: type) -> dict[str, Any]:
    docs = parse_docstring(cls.__doc__ or "")[1]
    fields = []
    for name, info in cls.model_fields.items():
        annotation = info.annotation
        default = None if info.is_required() else info.default
        description = info.description or docs.get(name)
        fields.append((info.alias or name, annotation, info.is_required(), default, description))
    return object_schema(fields)


def resolve_hints(obj: Any) -> dict[str, Any]:
    """Type hints with string annotations (`from __future__ import annotations`) resolved."""
    try:
        return typing.get_type_hints(obj, include_extras=True)
    except NameError as e:
        raise TypeError(
            f"cannot resolve the type hints of {getattr(obj, '__qualname__', obj)!r}: {e}; "
            "define the types it uses at module level"
        ) from e


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {param: description}) from a Google- or numpy-style docstring."""
    lines = inspect.cleandoc(doc).splitlines() if doc else []
    description: list[str] = []
    params: dict[str, str] = {}
    section: str | None = None
    is_numpy = False
    body: list[str] = []
    i = 0
    while i < len(lines):
        header = _SECTION.match(lines[i])
        underlined = i + 1 < len(lines) and bool(_NUMPY_RULE.match(lines[i + 1]))
        if (
            header
            and not lines[i].startswith((" ", "\t"))
            and (lines[i].rstrip().endswith(":") or underlined)
        ):
            if section in _PARAM_SECTIONS:
                params.update(_parse_params(body, is_numpy=is_numpy))
            section, is_numpy, body = header.group(1), underlined, []
            i += 2 if underlined else 1
            continue
        (description if section is None else body).append(lines[i])
        i += 1
    if section in _PARAM_SECTIONS:
        params.update(_parse_params(body, is_numpy=is_numpy))
    return "\n".join(description).strip(), params


def _parse_params(body: list[str], *, is_numpy: bool) -> dict[str, str]:
    """Lines at the section's base indent start a parameter; deeper lines continue it."""
    indents = [len(line) - len(line.lstrip()) for line in body if line.strip()]
    base = min(indents, default=0)
    params: dict[str, list[str]] = {}
    current: str | None = None
    for line in body:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        match = (_NUMPY_PARAM if is_numpy else _GOOGLE_PARAM).match(line)
        if indent == base and match:
            current = match.group(1)
            # numpy puts the type after the colon; Google puts the description there
            params[current] = [] if is_numpy else [match.group(3)]
        elif current is not None:
            params[current].append(line.strip())
    return {name: " ".join(" ".join(parts).split()) for name, parts in params.items()}
