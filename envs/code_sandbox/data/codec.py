"""Typed serialisation shared by the grading harness and the solution worker (stdlib only).

Only exact builtin types pass: a subclass of int or an object with a custom __eq__ cannot be
encoded, so a result that "equals anything" never reaches a comparison.
"""

import math

_SCALARS = {bool: "b", int: "i", str: "s"}


def encode(value, depth=0):
    if depth > 100:
        raise ValueError("value nested deeper than 100 levels")
    t = type(value)
    if value is None:
        return None
    if t in _SCALARS:
        return {_SCALARS[t]: str(value) if t is int else value}
    if t is float:
        return {"f": repr(value) if math.isfinite(value) else str(value)}
    if t is complex:
        return {"c": [repr(value.real), repr(value.imag)]}
    if t is bytes:
        return {"y": value.hex()}
    if t in (list, tuple, set, frozenset):
        tag = {list: "l", tuple: "t", set: "S", frozenset: "F"}[t]
        return {tag: [encode(x, depth + 1) for x in value]}
    if t is dict:
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    raise TypeError(f"cannot pass a value of type {t.__name__} (only builtin types)")


def decode(obj):
    if obj is None:
        return None
    if type(obj) is not dict or len(obj) != 1:
        raise ValueError("malformed encoded value")
    ((tag, v),) = obj.items()
    if tag == "b":
        return bool(v)
    if tag == "i":
        return int(v)
    if tag == "s":
        return str(v)
    if tag == "f":
        return float(v)
    if tag == "c":
        return complex(float(v[0]), float(v[1]))
    if tag == "y":
        return bytes.fromhex(v)
    if tag in ("l", "t", "S", "F"):
        items = [decode(x) for x in v]
        return {"l": list, "t": tuple, "S": set, "F": frozenset}[tag](items)
    if tag == "d":
        return {decode(k): decode(x) for k, x in v}
    raise ValueError(f"unknown tag {tag!r}")
