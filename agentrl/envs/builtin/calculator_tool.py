"""The `calculate` tool of the built-in `calculator` env: safe arithmetic on numbers (an AST
walk, no eval), results written as the model should copy them."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from agentrl.tools import tool

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_POWER_DIGITS = 1000
"""Caps `a ** b` so a model cannot ask for a number with billions of digits (a thread
running a tool cannot be stopped, so the tool's timeout would not save us)."""

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate(expression: str) -> int | float:
    """Evaluate arithmetic on numbers with + - * / // % ** and parentheses. No names, no calls."""
    text = expression.strip().rstrip("=").strip()
    text = text.replace("×", "*").replace("÷", "/").replace("^", "**")  # how people write it
    if not text:
        raise ValueError("empty expression; write one like '17 + 25'")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(
            f"expression is {len(text)} characters long; the limit is {MAX_EXPRESSION_CHARS}"
        )
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"cannot parse {text!r}: {e.msg}") from None
    return _eval_node(tree.body)


def _eval_node(node: ast.AST) -> int | float:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, (int, float))
        and not isinstance(node.value, bool)  # True and False are ints, not numbers here
    ):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval_node(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left = _eval_node(node.left)
        right = _eval_node(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, complex):
            raise ValueError("the result is not a real number")
        return result
    raise ValueError(
        f"unsupported syntax {ast.unparse(node)!r}: use numbers, + - * / // % ** and parentheses"
    )


def _check_power(base: int | float, exponent: int | float) -> None:
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"exponent {exponent} is too large; the limit is {MAX_EXPONENT}")
    if base != 0 and exponent > 0 and exponent * math.log10(abs(base)) > MAX_POWER_DIGITS:
        raise ValueError(f"the result would have more than {MAX_POWER_DIGITS} digits")


def format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.10g}"
    return str(value)


@tool(timeout_s=5.0, max_output_tokens=64)
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: Arithmetic with numbers, + - * / // % ** and parentheses, e.g. "(17 + 25) * 3".
    """
    return format_number(evaluate(expression))
