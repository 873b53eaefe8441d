"""A calculator as an MCP server, written with the official `mcp` SDK as any MCP user writes one.

    python examples/mcp/calculator_server.py                 # stdio: `mcp/tools-v0` starts it itself
    python examples/mcp/calculator_server.py --port 8000     # streamable HTTP at http://127.0.0.1:8000/mcp

It evaluates what `math/arith-v0`'s own `calculator` tool evaluates (exact fractions; integers printed as integers,
other values to 6 decimals), so GRPO through this server can be compared with GRPO through the in-process tool
(docs/guides/mcp.md).
"""

import argparse
import ast
import operator
from fractions import Fraction
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
             ast.USub: operator.neg, ast.UAdd: operator.pos}

server = MCPServer("calculator")


def value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = value(node.left), value(node.right)
        if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) > 8):
            raise ToolError("exponents must be whole numbers up to 8")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ToolError("division by zero")
        result = Fraction(OPERATORS[type(node.op)](left, right))
        if abs(result) > 10**12:
            raise ToolError("value out of range (|x| > 10**12)")
        return result
    raise ToolError(f"unsupported syntax: {type(node).__name__}; use numbers, + - * / ** and ( )")


@server.tool(description="Evaluate an arithmetic expression exactly.")
def calculator(expression: Annotated[str, Field(description='Numbers with + - * / ** and parentheses, '
                                                             'e.g. "3 * (4 + 5)".')]) -> str:
    if len(expression) > 500:
        raise ToolError("expression too long (max 500 characters)")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ToolError(f"not an arithmetic expression: {e.msg}") from None
    result = value(tree.body)
    return str(result.numerator) if result.denominator == 1 else f"{float(result):.6f}".rstrip("0").rstrip(".")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, help="serve streamable HTTP on this port (default: stdio)")
    port = parser.parse_args().port
    if port:
        server.run("streamable-http", port=port)
    else:
        server.run()
