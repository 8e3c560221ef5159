"""Schemas derived by `@tool` from type hints and docstrings, one supported type at a time."""

from __future__ import annotations

import dataclasses
import enum
from typing import Annotated, Literal, Optional

import jsonschema
import pydantic
import pytest

from agentrl.tools import tool
from agentrl.tools.schema import parse_docstring


class Unit(enum.Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


@dataclasses.dataclass
class Point:
    """A point on the map.

    Attributes:
        lat: Latitude in degrees.
        lon: Longitude in degrees.
    """

    lat: float
    lon: float = 0.0


@dataclasses.dataclass
class Route:
    start: Point
    stops: list[Point]


class Filter(pydantic.BaseModel):
    field: str = pydantic.Field(description="Column to filter on.")
    limit: int = 10


def params_of(fn) -> dict:
    return tool(fn).schema()["function"]["parameters"]


def test_primitives_and_docstring_descriptions() -> None:
    def lookup(query: str, k: int, threshold: float, exact: bool) -> str:
        """Search the index.

        Returns the best matches.

        Args:
            query: What to look for. It may span
                two lines.
            k: How many results.
        """
        return ""

    schema = tool(lookup).schema()
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "lookup"
    assert fn["description"] == "Search the index.\n\nReturns the best matches."
    props = fn["parameters"]["properties"]
    assert props["query"] == {
        "type": "string",
        "description": "What to look for. It may span two lines.",
    }
    assert props["k"] == {"type": "integer", "description": "How many results."}
    assert props["threshold"] == {"type": "number"}
    assert props["exact"] == {"type": "boolean"}
    assert fn["parameters"]["required"] == ["query", "k", "threshold", "exact"]


def test_numpy_docstring() -> None:
    def add(a: int, b: int = 2) -> int:
        """Add two numbers.

        Parameters
        ----------
        a : int
            The first number.
        b : int
            The second
            number.
        """
        return a + b

    props = params_of(add)["properties"]
    assert props["a"]["description"] == "The first number."
    assert props["b"] == {"type": "integer", "description": "The second number.", "default": 2}


def test_enum_and_literal() -> None:
    def convert(unit: Unit, mode: Literal["fast", "exact"], level: Literal[1, 2, 3] = 1) -> str:
        return ""

    props = params_of(convert)["properties"]
    assert props["unit"] == {"type": "string", "enum": ["celsius", "fahrenheit"]}
    assert props["mode"] == {"type": "string", "enum": ["fast", "exact"]}
    assert props["level"] == {"type": "integer", "enum": [1, 2, 3], "default": 1}


def test_lists_dicts_and_optionals_are_not_required() -> None:
    def f(
        ids: list[int],
        tags: dict[str, str],
        meta: dict,
        note: str | None,
        old: Optional[int] = None,  # noqa: UP045 (typing.Optional is what is under test)
    ) -> str:
        return ""

    params = params_of(f)
    props = params["properties"]
    assert props["ids"] == {"type": "array", "items": {"type": "integer"}}
    assert props["tags"] == {"type": "object", "additionalProperties": {"type": "string"}}
    assert props["meta"] == {"type": "object"}
    assert props["note"] == {"type": "string"}
    assert props["old"] == {"type": "integer"}
    assert params["required"] == ["ids", "tags", "meta"]


def test_nested_dataclasses() -> None:
    def plan(route: Route) -> str:
        return ""

    route = params_of(plan)["properties"]["route"]
    point = {
        "type": "object",
        "properties": {
            "lat": {"type": "number", "description": "Latitude in degrees."},
            "lon": {"type": "number", "description": "Longitude in degrees.", "default": 0.0},
        },
        "required": ["lat"],
        "additionalProperties": False,  # what validation does: an unknown key is refused
    }
    assert route == {
        "type": "object",
        "properties": {"start": point, "stops": {"type": "array", "items": point}},
        "required": ["start", "stops"],
        "additionalProperties": False,
    }
    args = tool(plan).args_model
    args.model_validate_json('{"route": {"start": {"lat": 1.0}, "stops": []}}')
    with pytest.raises(pydantic.ValidationError, match="route.start.alt"):
        args.model_validate_json('{"route": {"start": {"lat": 1.0, "alt": 2}, "stops": []}}')


def test_pydantic_model() -> None:
    def query(filter: Filter) -> str:
        return ""

    assert params_of(query)["properties"]["filter"] == {
        "type": "object",
        "properties": {
            "field": {"type": "string", "description": "Column to filter on."},
            "limit": {"type": "integer", "default": 10},
        },
        "required": ["field"],
    }


def test_annotated_description_and_method_self_skipped() -> None:
    class Env:
        @tool(name="find", timeout_s=3)
        def search(self, query: Annotated[str, "Free text."]) -> str:
            """Find pages."""
            return f"{id(self)}:{query}"

    env = Env()
    bound = env.search
    assert bound.name == "find" and bound.timeout_s == 3
    assert bound.parameters == {
        "type": "object",
        "properties": {"query": {"type": "string", "description": "Free text."}},
        "required": ["query"],
    }
    assert bound("x") == f"{id(env)}:x"
    assert bound.limit is Env.search.limit  # limits are shared by every bound copy


def test_every_schema_is_valid_json_schema() -> None:
    def everything(
        a: Unit, b: list[Route], c: Filter | None = None, d: dict[str, list[float]] | None = None
    ) -> str:
        return ""

    params = params_of(everything)
    jsonschema.Draft202012Validator.check_schema(params)
    jsonschema.validate({"a": "celsius", "b": [{"start": {"lat": 1}, "stops": []}]}, params)


def test_unsupported_type_fails_at_decoration_naming_the_type() -> None:
    def f(x: complex) -> str:
        return ""

    with pytest.raises(TypeError, match="complex"):
        tool(f)


def test_parse_docstring_without_sections() -> None:
    assert parse_docstring("Just a summary.") == ("Just a summary.", {})
    assert parse_docstring("") == ("", {})
