"""Safe arithmetic: the calculator tool and the process verifier both evaluate expressions with this.

Only numbers, + - * / // % ** (small exponents) and parentheses; anything else is an error message,
never an exception escaping to the env or a huge computation.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

MAX_ABS = 10**12  # results beyond this are refused: no legitimate problem here needs them
MAX_EXPONENT = 8

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class ExpressionError(ValueError):
    """The expression is not plain arithmetic, or its value is out of range."""


def evaluate(expression: str) -> Fraction:
    """Exact value of an arithmetic expression (Fractions, so 7/2*2 == 7 exactly)."""
    if len(expression) > 500:
        raise ExpressionError("expression too long (max 500 characters)")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        raise ExpressionError(f"not an arithmetic expression: {e.msg if isinstance(e, SyntaxError) else e}")
    return _eval(tree.body)


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = Fraction(node.value)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_eval(node.operand))
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) > MAX_EXPONENT):
            raise ExpressionError(f"exponents must be whole numbers up to {MAX_EXPONENT}")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ExpressionError("division by zero")
        value = _BINARY[type(node.op)](left, right)
        value = Fraction(value)
    else:
        raise ExpressionError(f"unsupported syntax: {type(node).__name__}; use numbers, + - * / ** and ( )")
    if abs(value) > MAX_ABS:
        raise ExpressionError(f"value out of range (|x| > {MAX_ABS})")
    return value


def format_number(value: Fraction) -> str:
    """Integers as integers; other values as a decimal rounded to 6 places."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")
