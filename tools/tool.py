"""`@tool`: a typed Python function with a Google-style docstring becomes a `Tool` with an OpenAI schema.

    @tool(timeout=5)
    def search(query: str, k: int = 3) -> str:
        '''Search the corpus.

        Args:
            query: What to look for.
            k: How many passages to return.
        '''

The schema comes from `transformers.utils.get_json_schema`, the same function chat templates use, so the
model sees exactly what HF would render. Arguments are validated strictly (see `arguments.py`) before the
function runs, and every call has a timeout.
"""

from __future__ import annotations

import copy
import inspect
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, overload

from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

from agentrl.tools.arguments import ArgumentValidator
from agentrl.tools.errors import ToolError, ToolTimeout

DEFAULT_TIMEOUT = 10.0


@dataclass(frozen=True)
class Tool:
    """A function the model can call. `schema` is the OpenAI function format that chat templates render."""

    name: str
    description: str
    fn: Callable[..., Any]
    schema: dict[str, Any]
    timeout: float = DEFAULT_TIMEOUT  # seconds; every tool call has one (DESIGN.md, "Failures are data")
    _validator: ArgumentValidator = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"tool {self.name}: timeout must be > 0 seconds, got {self.timeout}")
        if inspect.iscoroutinefunction(self.fn):
            # Calling it would return an un-awaited coroutine, which would be silently turned into text.
            raise TypeError(f"tool {self.name}: async functions are not supported; wrap it in a sync function")
        if self.schema.get("function", {}).get("name") != self.name:
            raise ValueError(f"tool {self.name}: schema names a different function: {self.schema.get('function')}")
        object.__setattr__(self, "_validator", ArgumentValidator(self.name, self.fn))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The plain function, so a decorated function stays callable from Python (no validation, no timeout)."""
        return self.fn(*args, **kwargs)

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Strictly validated arguments, or `ToolArgumentError` with a message for the model."""
        return self._validator(arguments)

    def run(self, arguments: dict[str, Any]) -> str:
        """Validates, runs the function with a timeout and returns its result as text.

        Raises `ToolArgumentError` for bad arguments (the model's mistake), `ToolTimeout` when the function runs
        past `timeout`, and `ToolError` when it raises (both infrastructure failures).

        The function runs in a fresh daemon thread. A Python thread cannot be killed, so on timeout the thread
        is abandoned and keeps running in the background until it returns (daemon: it does not block exit).
        That is acceptable for in-process tools; tools that run untrusted or heavy work must use a sandbox,
        which enforces its own wall-clock kill.
        """
        kwargs = self.validate(arguments)
        outcome: dict[str, Any] = {}

        def target() -> None:
            try:
                outcome["value"] = self.fn(**kwargs)
            except Exception as e:  # the one broad catch: any failure of the tool's own code becomes a ToolError
                outcome["error"] = e

        thread = threading.Thread(target=target, name=f"tool-{self.name}", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            raise ToolTimeout(f"tool {self.name} timed out after {self.timeout:g}s (its thread was abandoned)")
        if "error" in outcome:
            e = outcome["error"]
            raise ToolError(f"tool {self.name} failed: {type(e).__name__}: {e}") from e
        if "value" not in outcome:  # e.g. SystemExit inside the thread, which `except Exception` lets through
            raise ToolError(f"tool {self.name} failed: it exited without returning")
        return _to_text(self.name, outcome["value"])


def _to_text(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (ValueError, RecursionError) as e:  # circular or too deeply nested results
        raise ToolError(f"tool {name} failed: its result cannot be written as JSON: {type(e).__name__}: {e}") from e


def _make_tool(fn: Callable[..., Any], name: str | None, timeout: float) -> Tool:
    try:
        schema = get_json_schema(fn)
    except (TypeHintParsingException, DocstringParsingException) as e:
        fn_name = getattr(fn, "__name__", repr(fn))
        raise TypeError(
            f"@tool cannot build a schema for {fn_name}: {e}. Fix: give every parameter a type hint and write a "
            f"Google-style docstring with a one-line description and an 'Args:' section describing every parameter."
        ) from e
    function = schema["function"]
    function.pop("return", None)  # not part of the OpenAI function format that templates expect
    if name is not None:
        function["name"] = name
    schema = {"type": "function", "function": function}
    return Tool(function["name"], function["description"], fn, copy.deepcopy(schema), timeout)


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...
@overload
def tool(*, name: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None, /, *, name: str | None = None, timeout: float = DEFAULT_TIMEOUT
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Decorator: `@tool` or `@tool(name=..., timeout=...)` turns a typed, documented function into a `Tool`."""
    if fn is not None:
        return _make_tool(fn, name, timeout)
    return lambda f: _make_tool(f, name, timeout)
