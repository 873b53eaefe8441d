"""An MCP server for the tests of `agentrl.tools.mcp`, written with the official SDK: tools that answer, fail, hang,
flood, keep state, start a child process, send a JSON-RPC server error, and kill their own server.

    python tests/data/mcp_server.py                # stdio
    python tests/data/mcp_server.py --port 8000    # streamable HTTP
"""

import argparse
import os
import subprocess
import time

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError

server = MCPServer("testing")
calls = 0


@server.tool(description="Add two integers.")
def add(a: int, b: int) -> int:
    return a + b


@server.tool(description="Fail with a message for the model.")
def refuse(reason: str) -> str:
    raise ToolError(f"refused: {reason}")


@server.tool(description="Fail with a JSON-RPC server error of code -32000 (the code the SDK also uses for a closed "
                         "connection).")
def busy() -> str:
    raise MCPError(-32000, "the server is busy")


@server.tool(description="Sleep, then say so.")
def sleep(seconds: float) -> str:
    time.sleep(seconds)
    return f"slept {seconds}"


@server.tool(description="A long text.")
def flood(chars: int) -> str:
    return "x" * chars


@server.tool(description="How many calls this server process has answered, this one included.")
def count() -> int:
    global calls
    calls += 1
    return calls


@server.tool(description="The server's process id and a child process it started that sleeps for 10 minutes.")
def spawn() -> str:
    child = subprocess.Popen(["sleep", "600"])
    return f"{os.getpid()} {child.pid}"


@server.tool(description="End the server process at once.")
def crash() -> str:
    os._exit(3)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int)
    port = parser.parse_args().port
    if port:
        server.run("streamable-http", port=port)
    else:
        server.run()
