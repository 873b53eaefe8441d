"""`mcp/tools-v0`: question-answer tasks from a file, answered with the tools of MCP servers."""

from agentrl.envs.mcp.env import McpToolsEnv, load_tasks

__all__ = ["McpToolsEnv", "load_tasks"]
