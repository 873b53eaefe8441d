"""Strict validation of a tool call's arguments against the tool function's signature (pydantic).

Strict means no silent coercion: `"3"` is not an int and `3` is not a str. The model learns the schema it was
shown instead of being rescued by lenient parsing it will not get elsewhere. (Ints are accepted for floats,
as JSON does not tell them apart.)
"""

from __future__ import annotations

import inspect
import json
import reprlib
import typing
from collections.abc import Callable
from typing import Any

import pydantic
from typing_extensions import NotRequired, Required, TypedDict

from agentrl.tools.errors import ToolArgumentError

# Short reprs of the offending value, safe on huge or deeply nested inputs.
_short = reprlib.Repr()
_short.maxstring = 40
_short.maxother = 40
_short.maxlevel = 2


class ArgumentValidator:
    """Validates `arguments` dicts for one tool function; built once per tool."""

    def __init__(self, tool_name: str, fn: Callable[..., Any]):
        self.tool_name = tool_name
        fields = _fields_from_signature(tool_name, fn)
        self.names = tuple(fields)
        # A TypedDict (not a BaseModel) so parameter names like `json` or `schema` cannot clash with model attributes.
        args_type = TypedDict(f"{tool_name}_arguments", fields)  # type: ignore[misc]
        args_type.__pydantic_config__ = pydantic.ConfigDict(strict=True, extra="forbid")  # type: ignore[attr-defined]
        self._adapter = pydantic.TypeAdapter(args_type)

    def __call__(self, arguments: Any) -> dict[str, Any]:
        """Returns the validated arguments (only those given; the function's defaults fill the rest)."""
        check_json_object(self.tool_name, arguments)
        try:
            return dict(self._adapter.validate_python(arguments))
        except pydantic.ValidationError as e:
            problems = "; ".join(self._describe_error(err) for err in e.errors(include_url=False))
            raise ToolArgumentError(f"{self.tool_name}: {problems}") from None

    def _describe_error(self, err: Any) -> str:
        path = _format_path(err["loc"])
        if err["type"] == "missing":
            return f"missing required argument '{path}'"
        if err["type"] == "extra_forbidden":
            expected = ", ".join(self.names) or "none"
            return f"unexpected argument '{path}' (arguments: {expected})"
        return f"argument '{path}' {_readable(err['msg'])} (got {_describe(err['input'])})"


def check_json_object(tool_name: str, arguments: Any) -> None:
    """`ToolArgumentError` unless `arguments` is a JSON object whose strings are all characters (what every tool,
    `@tool` or MCP, needs before its own checks)."""
    if not isinstance(arguments, dict):
        raise ToolArgumentError(f"{tool_name}: arguments must be a JSON object (got {_describe(arguments)})")
    if half := lone_surrogate(arguments):
        raise ToolArgumentError(f"{tool_name}: the arguments hold {half}, half of a surrogate pair, not a character")


def lone_surrogate(value: Any) -> str | None:
    """The first lone UTF-16 surrogate in `value`'s strings, escaped (`\\ud800`), or None. JSON can write one
    (`"\\ud800"`); no program, file name or tokenizer takes it."""
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError as e:
        return e.object[e.start:e.end].encode("unicode_escape").decode()
    except (TypeError, ValueError):  # not JSON at all: pydantic says what is wrong with it
        pass
    return None


def _fields_from_signature(tool_name: str, fn: Callable[..., Any]) -> dict[str, Any]:
    """TypedDict fields: parameters without defaults are Required, the others NotRequired."""
    hints = typing.get_type_hints(fn, include_extras=True)
    fields: dict[str, Any] = {}
    for param in inspect.signature(fn).parameters.values():
        if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            # Tools are called as fn(**arguments), so *args, **kwargs and positional-only parameters cannot be filled.
            raise TypeError(f"tool {tool_name}: parameter '{param.name}' must be a plain or keyword-only parameter "
                            f"(tools are called with keyword arguments from JSON)")
        if param.name not in hints:
            raise TypeError(f"tool {tool_name}: parameter '{param.name}' needs a type hint")
        wrap = Required if param.default is param.empty else NotRequired
        fields[param.name] = wrap[hints[param.name]]
    return fields


def _format_path(loc: tuple[Any, ...]) -> str:
    """('tags', 1) -> tags[1]; ('opts', 'k') -> opts.k"""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _readable(msg: str) -> str:
    """Pydantic's 'Input should be a valid string' -> 'must be a string', in JSON words the model was shown."""
    msg = msg.replace("Input should be", "must be")
    json_words = (("a valid dictionary", "an object"), ("a valid list", "an array"), ("a valid integer", "an integer"))
    for py, js in json_words:
        msg = msg.replace(py, js)
    return msg.replace("a valid ", "a ")


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {_short.repr(value)}"
