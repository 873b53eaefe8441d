"""@tool schemas, strict argument validation, timeouts, and ToolSet's corrective messages."""

from __future__ import annotations

import time

import pytest

from agentrl.tools import Tool, ToolArgumentError, ToolError, ToolSet, ToolTimeout, tool
from agentrl.types import ToolCall


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. "2 * (3 + 4)".
    """
    allowed = set("0123456789+-*/(). ")
    if not set(expression) <= allowed:
        return f"Error: only digits and + - * / ( ) are allowed, got {expression!r}"
    return str(eval(expression))  # safe: the character set above admits only arithmetic


@tool(name="web_search", timeout=2.5)
def search(query: str, k: int = 3, tags: list[str] | None = None, weight: float = 1.0) -> list[str]:
    """Search the corpus for passages.

    Args:
        query: What to look for.
        k: How many passages to return.
        tags: Only passages with one of these tags.
        weight: Relevance weight.
    """
    return [f"{query} #{i}" for i in range(k)]


def test_schema_is_the_openai_function_format():
    assert search.schema == {
        "type": "function",
        "function": {
            "name": "web_search",
            "description": "Search the corpus for passages.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "What to look for."},
                    "k": {"type": "integer", "description": "How many passages to return."},
                    "tags": {
                        "type": "array",
                        "items": {"type": "string"},
                        "nullable": True,
                        "description": "Only passages with one of these tags.",
                    },
                    "weight": {"type": "number", "description": "Relevance weight."},
                },
                "required": ["query"],
            },
        },
    }
    assert (search.name, search.description, search.timeout) == ("web_search", "Search the corpus for passages.", 2.5)
    assert calculator.name == "calculator" and calculator.timeout == 10.0
    assert calculator("1 + 2") == "3"  # a decorated function stays callable from Python


def test_functions_without_hints_or_docstring_are_rejected_with_the_fix():
    def no_hint(x):
        """Do it.

        Args:
            x: A thing.
        """

    def no_doc(x: int) -> int:
        return x

    def undocumented_arg(x: int) -> int:
        """Do it."""

    for fn in (no_hint, no_doc, undocumented_arg):
        with pytest.raises(TypeError, match="Fix: give every parameter a type hint"):
            tool(fn)


def test_async_functions_are_rejected():
    async def fetch(url: str) -> str:
        """Fetch a page.

        Args:
            url: The address.
        """
        return url

    with pytest.raises(TypeError, match="async"):
        tool(fetch)


def test_validate_returns_given_arguments_and_accepts_ints_for_floats():
    assert search.validate({"query": "paris", "k": 2}) == {"query": "paris", "k": 2}
    assert search.validate({"query": "x", "weight": 2}) == {"query": "x", "weight": 2.0}
    assert search.validate({"query": "x", "tags": None}) == {"query": "x", "tags": None}


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({"expression": 3}, "calculator: argument 'expression' must be a string (got int 3)"),
        ({}, "calculator: missing required argument 'expression'"),
        ({"expression": "1", "y": 2}, "calculator: unexpected argument 'y' (arguments: expression)"),
        (["1 + 2"], "calculator: arguments must be a JSON object (got list"),
    ],
)
def test_validation_errors_are_short_and_readable(arguments, expected):
    with pytest.raises(ToolArgumentError) as info:
        calculator.validate(arguments)
    assert str(info.value).startswith(expected)


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        ({"query": "x", "k": "3"}, "argument 'k' must be an integer (got str '3')"),  # strict: no "3" -> 3
        ({"query": "x", "k": True}, "argument 'k' must be an integer (got bool True)"),
        ({"query": "x", "k": 2.5}, "argument 'k' must be an integer"),
        ({"query": "x", "tags": ["a", 7]}, "argument 'tags[1]' must be a string (got int 7)"),
        ({"query": "x", "tags": "a"}, "argument 'tags' must be an array"),
    ],
)
def test_validation_is_strict(arguments, fragment):
    with pytest.raises(ToolArgumentError, match="web_search: ") as info:
        search.validate(arguments)
    assert fragment in str(info.value)


def test_run_converts_results_to_text():
    assert calculator.run({"expression": "6 * 7"}) == "42"
    assert search.run({"query": "été", "k": 2}) == '["été #0", "été #1"]'
    with pytest.raises(ToolArgumentError):
        calculator.run({"expression": 6})


def test_a_tool_that_raises_becomes_a_tool_error_with_its_cause():
    with pytest.raises(ToolError, match="tool calculator failed: ZeroDivisionError: division by zero") as info:
        calculator.run({"expression": "1 / 0"})
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert not isinstance(info.value, ToolTimeout)


def test_a_hung_tool_times_out_quickly():
    @tool(timeout=0.2)
    def slow(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "done"

    t0 = time.monotonic()
    with pytest.raises(ToolTimeout, match="tool slow timed out after 0.2s"):
        slow.run({"seconds": 30})
    assert time.monotonic() - t0 < 1.0
    assert slow.run({"seconds": 0}) == "done"


def test_tool_rejects_a_bad_timeout_and_a_mismatched_schema():
    with pytest.raises(ValueError, match="timeout must be > 0"):
        Tool("calculator", "d", calculator.fn, calculator.schema, timeout=0)
    with pytest.raises(ValueError, match="different function"):
        Tool("calc", "d", calculator.fn, calculator.schema)


def test_unserialisable_results_are_tool_errors():
    @tool
    def loop() -> list:
        """Return a list that contains itself."""
        x: list = []
        x.append(x)
        return x

    with pytest.raises(ToolError, match="cannot be written as JSON"):
        loop.run({})


@pytest.fixture
def tools() -> ToolSet:
    return ToolSet([calculator, search])


def test_toolset_lookup_and_fresh_schemas(tools):
    assert tools.names == ["calculator", "web_search"]
    assert tools.get("calculator") is calculator
    schemas = tools.schemas
    schemas[0]["function"]["name"] = "edited"
    assert tools.schemas[0]["function"]["name"] == "calculator"
    with pytest.raises(ValueError, match="unique"):
        ToolSet([calculator, calculator])


def test_check_accepts_valid_calls(tools):
    assert tools.check([ToolCall("calculator", {"expression": "1+1"})]) is None
    assert tools.check([]) is None


def test_check_refuses_lone_surrogates_from_any_parser(tools):
    """A ReAct or Search-R1 argument is raw text, not JSON: the same check holds there."""
    message = tools.check([ToolCall("calculator", {"expression": "1+\ud800"})])
    assert message == ("Invalid arguments for calculator: the arguments hold \\ud800, half of a surrogate pair, "
                       "not a character")
    assert message.encode()  # the observation itself can be tokenized


def test_check_counts_calls_per_turn(tools):
    calls = [ToolCall("calculator", {"expression": "1"})] * 3
    assert tools.check(calls) == "Only 1 tool call is allowed per turn; you made 3."
    two = ToolSet([calculator], max_calls_per_turn=2)
    assert two.check(calls) == "Only 2 tool calls are allowed per turn; you made 3."
    assert ToolSet([calculator], max_calls_per_turn=None).check(calls) is None


def test_check_suggests_close_tool_names(tools):
    message = tools.check([ToolCall("calculater", {"expression": "1"})])
    assert message == "Unknown tool 'calculater'. Did you mean 'calculator'? Available tools: calculator, web_search."
    message = tools.check([ToolCall("browse", {})])
    assert message == "Unknown tool 'browse'. Available tools: calculator, web_search."


def test_check_reports_invalid_arguments(tools):
    calls = [ToolCall("web_search", {"query": 1, "extra": 0})]
    message = ToolSet([calculator, search], max_calls_per_turn=None).check(calls)
    assert message.startswith("Invalid arguments for web_search: ")
    assert "argument 'query' must be a string (got int 1)" in message
    assert "unexpected argument 'extra'" in message


def test_toolset_run(tools):
    assert tools.run(ToolCall("calculator", {"expression": "2**10"})) == "1024"
    with pytest.raises(KeyError, match="Did you mean 'web_search'"):
        tools.run(ToolCall("web_serch", {"query": "x"}))
