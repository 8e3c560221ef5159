"""A tool's arguments as a pydantic model: the JSON schema the model sees, the validation of
what it writes, and errors it can act on. Parameter descriptions come from the docstring."""

from __future__ import annotations

import json
import types
import typing
from typing import Any

import docstring_parser
import pydantic
from pydantic.json_schema import GenerateJsonSchema

_SUPPORTED = (
    "use str, int, float, bool, an Enum or Literal, list[...], dict, X | None, a dataclass "
    "or a pydantic model"
)


class ArgumentError(ValueError):
    """An argument the model wrote does not fit the tool's signature; the text is shown to it."""


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {param: description}) from a Google-, numpy- or reST-style docstring."""
    parsed = docstring_parser.parse(doc or "")
    params = {p.arg_name: " ".join(p.description.split()) for p in parsed.params if p.description}
    return (parsed.description or "").strip(), params


def resolve_hints(obj: Any) -> dict[str, Any]:
    """Type hints with string annotations (`from __future__ import annotations`) resolved."""
    try:
        return typing.get_type_hints(obj, include_extras=True)
    except NameError as e:
        raise TypeError(
            f"cannot resolve the type hints of {getattr(obj, '__qualname__', obj)!r}: {e}; "
            "define the types it uses at module level"
        ) from e


def build_args_model(
    tool_name: str, params: list[tuple[str, Any, Any, str | None]], *, accepts_extra: bool
) -> type[pydantic.BaseModel]:
    """params: (name, annotation, default or `...` when required, description).

    Strict, so "3" is no integer and true no number; each field is aliased to its parameter,
    so a parameter may be called `schema` or `_id` without clashing with BaseModel.
    """
    fields: dict[str, Any] = {}
    for i, (name, annotation, default, description) in enumerate(params):
        text = _annotated_text(annotation) or description
        fields[f"arg{i}"] = (annotation, pydantic.Field(default, alias=name, description=text))
    config = pydantic.ConfigDict(extra="allow" if accepts_extra else "forbid", strict=True)
    try:
        return pydantic.create_model(tool_name, __config__=config, __doc__=None, **fields)
    except pydantic.PydanticSchemaGenerationError as e:
        raise TypeError(
            f"tool {tool_name!r}: {e.message.partition('. ')[0]}; {_SUPPORTED}"
        ) from None


def json_schema(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    """OpenAI's function-calling subset: no titles, no $ref, `X | None` as X (not required)."""
    schema = model.model_json_schema(schema_generator=_ToolSchema)
    schema = _inline(schema, schema.pop("$defs", {}), ())
    if not schema.get("additionalProperties"):  # said only where **kwargs takes extra ones
        schema.pop("additionalProperties", None)
    return schema


class _ToolSchema(GenerateJsonSchema):
    """pydantic's JSON schema, written the way function-calling schemas usually are."""

    def sort(self, value: Any, parent_key: str | None = None) -> Any:
        return value  # keep "type" first, as tool schemas are usually written

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False

    def nullable_schema(self, schema: Any) -> Any:
        return self.generate_inner(schema["schema"])

    def default_schema(self, schema: Any) -> Any:
        out = super().default_schema(schema)
        if "default" in out and out["default"] is None:  # None is no default the model can use
            del out["default"]
        return out

    def dict_schema(self, schema: Any) -> Any:
        out = super().dict_schema(schema)
        if out.get("additionalProperties") is True:
            del out["additionalProperties"]
        return out

    def literal_schema(self, schema: Any) -> Any:
        out = super().literal_schema(schema)
        if "const" in out:
            out["enum"] = [out.pop("const")]
        return out

    def dataclass_schema(self, schema: Any) -> Any:
        out = _documented(super().dataclass_schema(schema), schema["cls"])
        # A dataclass refuses unknown keys (its __init__ takes none); pydantic >= 2.14 says so
        # in the schema and older releases did not: say it always, so the model sees one schema.
        out.setdefault("additionalProperties", False)
        return out

    def model_schema(self, schema: Any) -> Any:
        return _documented(super().model_schema(schema), schema["cls"])

    def complex_schema(self, schema: Any) -> Any:
        raise TypeError(f"cannot derive a JSON schema for type complex; {_SUPPORTED}")


def _documented(schema: dict[str, Any], cls: type) -> dict[str, Any]:
    """A class's docstring describes its fields (`Attributes:`), not the object itself."""
    schema.pop("title", None)
    schema.pop("description", None)
    docs = parse_docstring(cls.__doc__ or "")[1]
    for name, prop in schema.get("properties", {}).items():
        if name in docs:
            prop.setdefault("description", docs[name])
    return schema


def _inline(node: Any, defs: dict[str, Any], seen: tuple[str, ...]) -> Any:
    if isinstance(node, list):
        return [_inline(item, defs, seen) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        if name in seen:
            raise TypeError(f"recursive type {name!r} has no inline JSON schema")
        # a class's name and docstring are no help to the model (an Enum's are added late)
        target = {k: v for k, v in defs[name].items() if k not in ("title", "description")}
        rest = {k: v for k, v in node.items() if k != "$ref"}
        return {**_inline(target, defs, (*seen, name)), **_inline(rest, defs, seen)}
    return {k: _inline(v, defs, seen) for k, v in node.items()}


def _annotated_text(tp: Any) -> str | None:
    """`Annotated[X, "text"]` -> "text"."""
    if typing.get_origin(tp) is typing.Annotated:
        return next((m for m in tp.__metadata__ if isinstance(m, str)), None)
    return None


def is_optional(tp: Any) -> bool:
    """`X | None`, `Optional[X]`, also under `Annotated`."""
    if typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    is_union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    return is_union and type(None) in typing.get_args(tp)


_TYPE_ERRORS = ("enum", "literal_error", "int_from_float", "model_attributes_type")


def argument_error(error: pydantic.ValidationError, schema: dict[str, Any]) -> ArgumentError:
    """The first problem, in the words of the JSON schema the model was shown."""
    first = error.errors(include_url=False)[0]
    kind = first["type"]
    loc = first["loc"]
    if kind == "extra_forbidden":
        parent_path, parent = _locate(schema, loc[:-1])
        accepted = ", ".join(parent.get("properties", {})) or "none"
        path = _join(parent_path, loc[-1])
        return ArgumentError(f"unexpected argument '{path}'; accepted arguments: {accepted}")
    path, expected = _locate(schema, loc)
    if kind == "missing":
        return ArgumentError(f"missing required argument '{path}' ({describe(expected)})")
    got = _got(first.get("input"))
    if kind.endswith(("_type", "_parsing")) or kind in _TYPE_ERRORS:
        return ArgumentError(f"argument '{path}' must be {describe(expected)}, got {got}")
    return ArgumentError(f"argument '{path}': {first['msg']} (got {got})")


def _locate(schema: dict[str, Any], loc: tuple[Any, ...]) -> tuple[str, dict[str, Any]]:
    """('items', 0, 'price') -> ("items[0].price", its schema); stops at a union arm's tag."""
    path = ""
    for part in loc:
        if isinstance(part, int) and "items" in schema:
            schema = schema["items"]
        elif isinstance(part, int) and part < len(schema.get("prefixItems", ())):
            schema = schema["prefixItems"][part]
        elif part in schema.get("properties", {}):
            schema = schema["properties"][part]
        elif isinstance(schema.get("additionalProperties"), dict):
            schema = schema["additionalProperties"]
        else:
            break
        path = _join(path, part)
    return path, schema


def _join(path: str, part: Any) -> str:
    if isinstance(part, int):
        return f"{path}[{part}]"
    return f"{path}.{part}" if path else str(part)


def describe(schema: dict[str, Any]) -> str:
    """A JSON schema in words, for error messages the model reads."""
    if "enum" in schema:
        return "one of " + ", ".join(json.dumps(v) for v in schema["enum"])
    if "anyOf" in schema:
        return " or ".join(describe(arm) for arm in schema["anyOf"])
    if schema.get("type") == "array" and "items" in schema:
        return f"array of {describe(schema['items'])}"
    return schema.get("type", "any value")


def _got(value: Any) -> str:
    kinds = {str: "string", bool: "boolean", int: "integer", float: "number", list: "array"}
    kind = "object" if isinstance(value, dict) else kinds.get(type(value), type(value).__name__)
    text = json.dumps(value, default=str)
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"{'null' if value is None else kind} {text}"
