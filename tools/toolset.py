"""`ToolSet`: the tools one environment offers, and the checks that turn the model's mistakes into messages.

A tool is a `Tool` (`@tool`) or anything with its interface: `name`, `schema`, `validate(arguments)`,
`run(arguments)`, such as the tools of MCP servers (`mcp.McpTool`), which also have `new_episode()` and `close()` for
servers that live as long as an episode or an env."""

from __future__ import annotations

import copy
import difflib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from agentrl.tools.errors import ToolArgumentError
from agentrl.tools.tool import Tool
from agentrl.types import ToolCall

if TYPE_CHECKING:
    from agentrl.tools.mcp import McpTool


class ToolSet:
    """Tools by name. `check` finds the model's mistakes in a turn's calls; `run` executes one call; `new_episode`
    and `close` pass the env's lifecycle to the tools that hold servers."""

    def __init__(self, tools: Sequence[Tool | McpTool], max_calls_per_turn: int | None = 1):
        if max_calls_per_turn is not None and max_calls_per_turn < 1:
            raise ValueError(f"max_calls_per_turn must be >= 1 or None (no limit), got {max_calls_per_turn}")
        self._tools: dict[str, Tool] = {}
        for t in tools:
            if t.name in self._tools:
                raise ValueError(f"two tools are named '{t.name}'; tool names must be unique")
            self._tools[t.name] = t
        self.max_calls_per_turn = max_calls_per_turn
        self._with_servers = [t for t in self._tools.values() if hasattr(t, "close")]

    @property
    def names(self) -> list[str]:
        """The tools' names, in the order they were given."""
        return list(self._tools)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """Fresh copies each call, so a caller that edits them cannot change the tools."""
        return [copy.deepcopy(t.schema) for t in self._tools.values()]

    def __len__(self) -> int:
        return len(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def get(self, name: str) -> Tool:
        """The tool named `name`; KeyError, with a message for the model (close names, the list), if there is none."""
        if name not in self._tools:
            raise KeyError(self._unknown_tool_message(name))
        return self._tools[name]

    def check(self, calls: Sequence[ToolCall]) -> str | None:
        """A corrective message for the model if these calls cannot be run as made, else None.

        Problems are reported together (one per line) so the model can fix them in one turn.
        """
        limit = self.max_calls_per_turn
        if limit is not None and len(calls) > limit:
            allowed = "1 tool call is" if limit == 1 else f"{limit} tool calls are"
            return f"Only {allowed} allowed per turn; you made {len(calls)}."
        problems = []
        for call in calls:
            if call.name not in self._tools:
                problems.append(self._unknown_tool_message(call.name))
                continue
            try:
                self._tools[call.name].validate(call.arguments)
            except ToolArgumentError as e:
                problems.append(f"Invalid arguments for {e}")
        return "\n".join(problems) or None

    def run(self, call: ToolCall) -> str:
        """Runs one call (see `Tool.run` for what it raises). Call `check` first to catch the model's mistakes."""
        return self.get(call.name).run(call.arguments)

    def new_episode(self) -> None:
        """An env starts an episode: tools whose servers must not outlive one restart them."""
        for t in self._with_servers:
            t.new_episode()

    def close(self) -> None:
        """The env closes: tools stop the servers they started for it."""
        for t in self._with_servers:
            t.close()

    def _unknown_tool_message(self, name: str) -> str:
        available = ", ".join(self._tools) or "none"
        close = difflib.get_close_matches(name, list(self._tools), n=3, cutoff=0.6)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        return f"Unknown tool {name!r}.{hint} Available tools: {available}."
