"""Tools the model can call: the `@tool` decorator, tool sets, and parsers that read tool calls from text."""

from agentrl.tools.errors import ToolArgumentError, ToolError, ToolTimeout
from agentrl.tools.parsers import PARSERS, HermesParser, ParsedAction, ReActParser, SearchR1Parser
from agentrl.tools.tool import Tool, tool
from agentrl.tools.toolset import ToolSet

__all__ = [
    "PARSERS",
    "HermesParser",
    "ParsedAction",
    "ReActParser",
    "SearchR1Parser",
    "Tool",
    "ToolArgumentError",
    "ToolError",
    "ToolSet",
    "ToolTimeout",
    "tool",
]
