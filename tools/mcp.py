"""Tools served by MCP servers (the Model Context Protocol), beside `@tool` functions in any `ToolEnv`.

    servers = [McpServer("calc", command=["python", "calculator_server.py"]),      # stdio: started here
               McpServer("docs", url="http://127.0.0.1:8000/mcp", timeout=30)]    # streamable HTTP: already up
    env = ArithmeticEnv(extra_tools=McpTools(servers))                             # or ToolSet([*mine, *McpTools(...)])

`McpTools` lists each server's tools through the official `mcp` SDK when it is built (once per process and
server, so that an env can put the tool schemas in its first prompt) and turns each into an `McpTool`: its schema
is the server's input schema in the OpenAI function format that chat templates render, its arguments are checked
against that schema before anything is sent (the model's mistakes become corrective observations, as with `@tool`),
every call has a timeout, and a result longer than `max_result_chars` is cut with a note saying so.

What becomes what:
- a result the server marks `isError` (the tool said it failed, e.g. bad input): an observation, `Error: ...`;
- an error response of the server to the call (MCP's protocol error): an observation too;
- no answer within `timeout`, or a server that died or cannot be reached: `ToolError`, so the episode ends as
  `error` with the reason and the next episode reconnects (a shared stdio server is started again).

Connections are pooled per process: envs that name the same server share one session, held open by one event loop
in a daemon thread until the process ends (`close_pooled()` ends them sooner). A server with `per_episode = true`
is started for one env and stopped when that env starts its next episode or closes, for servers with state that an
episode must not inherit. Every stdio server runs through `agentrl.system.lifetime.owned`, so it and whatever it
starts end with the process that started it, SIGKILL included.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TextIO

from agentrl.system.background import BackgroundLoop
from agentrl.system.lifetime import owned
from agentrl.tools.arguments import check_json_object
from agentrl.tools.errors import ToolArgumentError, ToolError, ToolTimeout
from agentrl.tools.tool import DEFAULT_TIMEOUT

CLOSE_TIMEOUT = 10.0  # seconds for a session to close (the SDK gives a stdio server 2 s, then SIGTERM, SIGKILL)
PING_TIMEOUT = 2.0  # seconds for a server to answer after a call timed out, before its session is reopened
LOG_DIR = Path.home() / ".cache" / "agentrl" / "logs" / "mcp"  # stdio servers' stderr, a file per server and process


@dataclass(frozen=True)
class McpServer:
    """How to reach one MCP server: `command` (stdio: the command is started here) or `url` (streamable HTTP)."""

    name: str
    command: tuple[str, ...] = ()  # e.g. ("python", "server.py"): a bare "python" is this process's interpreter
    url: str = ""  # e.g. "http://127.0.0.1:8000/mcp"
    env: Mapping[str, str] = field(default_factory=dict)  # added to the few variables the SDK passes on
    cwd: str = ""
    tools: tuple[str, ...] = ()  # only these of the server's tools (all when empty)
    prefix: str = ""  # put before each tool's name, when two servers have tools of the same name
    timeout: float = DEFAULT_TIMEOUT  # seconds for one call
    connect_timeout: float = 60.0  # seconds to start (stdio), connect and list the tools
    max_result_chars: int = 8000  # a longer result is cut, with a note saying how much was left out
    per_episode: bool = False  # a fresh server for each episode (stdio only)

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", tuple(self.command))
        object.__setattr__(self, "tools", tuple(self.tools))
        object.__setattr__(self, "env", dict(self.env))
        problems = []
        if not self.name:
            problems.append("name is empty")
        if bool(self.command) == bool(self.url):
            problems.append("give exactly one of command (a stdio server started here) or url (streamable HTTP)")
        if self.url and not self.url.startswith(("http://", "https://")):
            problems.append(f"url must start with http:// or https://, got {self.url!r}")
        if self.per_episode and not self.command:
            problems.append("per_episode needs a command: a server at a url was not started here and cannot be "
                            "restarted for each episode")
        if not (self.timeout > 0 and self.connect_timeout > 0 and self.max_result_chars > 0):
            problems.append("timeout, connect_timeout and max_result_chars must be > 0")
        if problems:
            raise ValueError(f"MCP server {self.name!r}: " + "; ".join(problems))

    def __hash__(self) -> int:  # `env` is a dict: hash what names the server
        return hash((self.name, self.command, self.url, tuple(sorted(self.env.items())), self.cwd))

    @classmethod
    def of(cls, spec: McpServer | Mapping[str, Any]) -> McpServer:
        """`spec` itself, or the server a recipe's table describes (unknown keys are an error that lists the known)."""
        if isinstance(spec, McpServer):
            return spec
        known = {f.name for f in fields(cls)}
        if unknown := set(spec) - known:
            raise ValueError(f"MCP server {spec.get('name', '?')!r}: unknown keys {sorted(unknown)}; "
                             f"known: {sorted(known)}")
        return cls(**spec)


class _Session:
    """One open MCP session, held by a task of the loop (the SDK's contexts must be left by the task that entered
    them) until `close`. `broken` says why it can no longer be used."""

    def __init__(self, server: McpServer):
        self.server = server
        self.client: Any = None
        self.broken: str | None = None
        self._stop: asyncio.Event | None = None
        self._held: asyncio.Task | None = None
        self._log: TextIO | None = None

    async def open(self) -> None:
        from mcp import Client  # the SDK, imported when a server is first used
        from mcp.client.stdio import StdioServerParameters, stdio_client

        if self.server.command:
            program, *rest = self.server.command
            command, *args = owned([sys.executable if program == "python" else program, *rest])
            params = StdioServerParameters(command=command, args=args, env=self.server.env or None,
                                           cwd=self.server.cwd or None)
            _log_path(self.server).parent.mkdir(parents=True, exist_ok=True)
            self._log = _log_path(self.server).open("a", buffering=1)
            transport: Any = stdio_client(params, errlog=self._log)
        else:
            transport = self.server.url
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._stop = asyncio.Event()
        self._held = asyncio.create_task(self._hold(Client(transport), ready))
        await ready

    async def _hold(self, client: Any, ready: asyncio.Future) -> None:
        try:
            async with client:
                self.client = client
                ready.set_result(None)
                await self._stop.wait()
        except BaseException as e:  # the SDK raises exception groups; whatever ended the session is its reason
            self.broken = self.broken or _reason(e)
            if not ready.done():
                ready.set_exception(ToolError(f"MCP server {self.server.name!r} did not start or answer: "
                                              f"{self.broken}{_log_hint(self.server)}"))
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            self.broken = self.broken or "the session was closed"
            if self._log is not None:
                self._log.close()

    async def close(self) -> None:
        self.broken = self.broken or "the session was closed"
        if self._stop is not None:
            self._stop.set()
        if self._held is not None:
            await asyncio.wait({self._held}, timeout=CLOSE_TIMEOUT)
            self._held.cancel()

    async def list_tools(self) -> list[Any]:
        tools, cursor = [], None
        while True:
            page = await self.client.list_tools(cursor=cursor)
            tools += page.tools
            if not (cursor := page.next_cursor):
                return tools

    async def _answers(self) -> bool:
        """Whether the server answers a listing of its tools within `PING_TIMEOUT` (after a call timed out: a tool
        still running leaves it answering; a result still streaming in does not). MCP's ping is deprecated."""
        try:
            await asyncio.wait_for(self.client.list_tools(), PING_TIMEOUT)
            return True
        except Exception:  # noqa: BLE001 -- any failure to answer means the same
            return False

    async def call(self, name: str, arguments: dict[str, Any]) -> Any:
        from mcp.shared.exceptions import MCPError
        from mcp_types import CONNECTION_CLOSED

        try:
            return await asyncio.wait_for(self.client.call_tool(name, arguments), self.server.timeout)
        except MCPError as e:
            # the server answered with an error: the model sees it. -32000 is also the first of JSON-RPC's server
            # error codes, so the SDK's "connection closed" is believed only if the server no longer answers.
            if e.code != CONNECTION_CLOSED or await self._answers():
                return e
            self.broken = self.broken or "the server closed the connection (its process ended?)"
            raise ToolError(f"MCP server {self.server.name!r} failed during a call of {name!r}: "
                            f"{self.broken}{_log_hint(self.server)}") from e
        except TimeoutError:
            if not await self._answers():  # a reply still arriving (a huge result) holds up every later one
                self.broken = self.broken or f"it stopped answering after a call of {name!r} timed out"
            raise ToolTimeout(f"MCP tool {name!r} of server {self.server.name!r} timed out after "
                              f"{self.server.timeout:g}s") from None
        except Exception as e:  # the connection failed under the call: this session is done
            self.broken = self.broken or _reason(e)
            raise ToolError(f"MCP server {self.server.name!r} failed during a call of {name!r}: "
                            f"{self.broken}{_log_hint(self.server)}") from e


class _Pool:
    """Sessions shared by every env of this process, one per server, reopened when one breaks."""

    def __init__(self) -> None:
        self.loop = BackgroundLoop("agentrl-mcp")
        self.shared: dict[McpServer, _Session] = {}
        self.listings: dict[McpServer, list[Any]] = {}
        self._locks: dict[McpServer, threading.Lock] = {}
        self._lock = threading.Lock()
        atexit.register(self.close)

    def open(self, server: McpServer) -> _Session:
        session = _Session(server)
        try:
            self.loop.run(session.open(), server.connect_timeout)
        except TimeoutError:
            self.loop.run(session.close(), CLOSE_TIMEOUT + 1)
            raise ToolError(f"MCP server {server.name!r} did not answer within connect_timeout="
                            f"{server.connect_timeout:g}s{_log_hint(server)}") from None
        return session

    def session(self, server: McpServer) -> _Session:
        """The shared session with `server`, opened (again) if there is none or it broke."""
        with self._lock:
            lock = self._locks.setdefault(server, threading.Lock())
        with lock:
            session = self.shared.get(server)
            if session is None or session.broken:
                session = self.shared[server] = self.open(server)
            return session

    def listing(self, server: McpServer, session: Callable[[], _Session]) -> list[Any]:
        """The server's tools, listed once per process (through `session()`, called only then)."""
        if server not in self.listings:
            self.listings[server] = self.loop.run(session().list_tools(), server.connect_timeout)
        return self.listings[server]

    def call(self, session: _Session, name: str, arguments: dict[str, Any]) -> Any:
        if session.broken:
            raise ToolError(f"MCP server {session.server.name!r} is gone: {session.broken}{_log_hint(session.server)}")
        return self.loop.run(session.call(name, arguments), session.server.timeout + 5)  # the session times out first

    def end(self, session: _Session) -> None:
        self.loop.run(session.close(), CLOSE_TIMEOUT + 1)

    def close(self) -> None:
        """Closes the shared sessions (the stdio servers end); the pool stays usable and reopens on demand."""
        with self._lock:
            sessions, self.shared = list(self.shared.values()), {}
        for session in sessions:
            try:
                self.end(session)
            except (TimeoutError, RuntimeError):  # at exit the loop may be gone; `owned` ends the servers anyway
                pass


_pool: _Pool | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


def pool() -> _Pool:
    """This process's pool (a forked child gets its own: the parent's loop thread does not exist there)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool, _pool_pid = _Pool(), os.getpid()
        return _pool


def close_pooled() -> None:
    """Ends this process's shared MCP sessions now, rather than at exit."""
    if _pool is not None and _pool_pid == os.getpid():
        _pool.close()


@dataclass(frozen=True, eq=False)
class McpTool:
    """One tool of an MCP server, with `Tool`'s interface (`name`, `schema`, `timeout`, `validate`, `run`)."""

    name: str  # as the model calls it: the server's name for it, after the server's `prefix`
    remote_name: str
    description: str
    schema: dict[str, Any]
    server: McpServer
    owner: McpTools = field(repr=False)
    _validator: Any = field(repr=False)

    @property
    def timeout(self) -> float:
        """Seconds one call may take: the server's `timeout`."""
        return self.server.timeout

    def validate(self, arguments: Any) -> dict[str, Any]:
        """`arguments` if the tool's input schema accepts them, else `ToolArgumentError` written for the model."""
        check_json_object(self.name, arguments)
        problems = sorted(self._validator.iter_errors(arguments), key=lambda e: list(e.absolute_path))
        if problems:
            raise ToolArgumentError(f"{self.name}: " + "; ".join(_describe(e) for e in problems[:5]))
        return arguments

    def run(self, arguments: dict[str, Any]) -> str:
        """The call's result as text (see the module's doc for what becomes an observation and what a `ToolError`)."""
        result = self.owner.call(self.server, self.remote_name, self.validate(arguments))
        return _capped(_as_text(result), self.server.max_result_chars)

    def new_episode(self) -> None:
        """See `McpTools.new_episode` (each tool of a set passes it on; it is idempotent)."""
        self.owner.new_episode()

    def close(self) -> None:
        """See `McpTools.close`."""
        self.owner.close()


class McpTools(Sequence[McpTool]):
    """The tools of `servers` (`McpServer`s or a recipe's tables of their fields), for one env.

    The first set built in a process connects to each server and lists its tools (later ones reuse the listing,
    and a per-episode server starts at its episode's first call); tool names must be unique across servers
    (`prefix` makes them so). `new_episode` and `close` stop the env's `per_episode`
    servers; `ToolSet` calls them when the env resets and closes."""

    def __init__(self, servers: Sequence[McpServer | Mapping[str, Any]]):
        self.servers = [McpServer.of(s) for s in servers]
        if len({s.name for s in self.servers}) < len(self.servers):
            raise ValueError(f"MCP server names must be unique, got {[s.name for s in self.servers]}")
        self._pool = pool()
        self._own: dict[McpServer, _Session] = {}  # per_episode servers of this env
        self._used: set[McpServer] = set()
        self._lock = threading.Lock()
        self._tools: list[McpTool] = []
        for server in self.servers:
            self._tools += self._tools_of(server)
        names = [t.name for t in self._tools]
        if dupes := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"MCP tools {dupes} are offered by more than one server; give one of them a prefix")

    def _tools_of(self, server: McpServer) -> list[McpTool]:
        from jsonschema import Draft202012Validator

        listed = {t.name: t for t in self._pool.listing(server, lambda: self._session(server, use=False))}
        if missing := [n for n in server.tools if n not in listed]:
            raise ValueError(f"MCP server {server.name!r} has no tools {missing}; it offers {sorted(listed)}")
        tools = []
        for t in (listed[n] for n in (server.tools or listed)):
            name = server.prefix + t.name
            schema = {"type": "function", "function": {"name": name, "description": t.description or "",
                                                       "parameters": untitled(t.input_schema)}}
            tools.append(McpTool(name, t.name, t.description or "", schema, server, self,
                                 Draft202012Validator(t.input_schema)))
        return tools

    def _session(self, server: McpServer, use: bool = True) -> _Session:
        if not server.per_episode:
            return self._pool.session(server)
        with self._lock:
            session = self._own.get(server)
            if session is None or session.broken:
                session = self._own[server] = self._pool.open(server)
            if use:
                self._used.add(server)
            return session

    def call(self, server: McpServer, name: str, arguments: dict[str, Any]) -> Any:
        """The raw result of tool `name` of `server` (its shared session, or this env's for a per-episode one)."""
        return self._pool.call(self._session(server), name, arguments)

    def new_episode(self) -> None:
        """Stops the per-episode servers that the last episode used (the next call starts a fresh one)."""
        self._end(self._used)

    def close(self) -> None:
        """Stops this env's per-episode servers; idempotent (shared ones stay in the pool)."""
        self._end(set(self._own))

    def _end(self, servers: set[McpServer]) -> None:
        with self._lock:
            ending = [self._own.pop(s) for s in list(servers) if s in self._own]
            self._used -= servers
        for session in ending:
            self._pool.end(session)

    def __getitem__(self, i):  # type: ignore[override]
        return self._tools[i]

    def __len__(self) -> int:
        return len(self._tools)

    def __iter__(self) -> Iterator[McpTool]:
        return iter(self._tools)


def untitled(schema: Any) -> Any:
    """`schema` without its `title` annotations (pydantic names every schema and property with one): the prompt
    shows what `@tool` schemas show, in fewer tokens. Properties named "title" stay; validation uses the original."""
    if not isinstance(schema, dict):
        return [untitled(s) for s in schema] if isinstance(schema, list) else schema
    out = {}
    for key, value in schema.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(value, dict):
            out[key] = {name: untitled(sub) for name, sub in value.items()}
        else:
            out[key] = untitled(value)
    return out


def _as_text(result: Any) -> str:
    """A call's result (or the server's error response) as the text of a tool message."""
    from mcp.shared.exceptions import MCPError

    if isinstance(result, MCPError):
        return f"Error: {result}"
    parts = []
    for block in result.content:
        if block.type == "text":
            parts.append(block.text)
        elif block.type == "resource" and hasattr(block.resource, "text"):
            parts.append(block.resource.text)
        elif block.type == "resource_link":
            parts.append(f"[resource: {block.uri}]")
        else:  # images and audio: a text-only model is told what it cannot see
            parts.append(f"[{block.type}: {getattr(block, 'mime_type', '')}]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    text = "\n".join(parts)
    return f"Error: {text}" if result.is_error and not text.startswith("Error") else text


def _capped(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n[... {len(text) - limit} more characters cut]"


def _describe(error: Any) -> str:
    where = ".".join(str(p) for p in error.absolute_path)
    return f"argument '{where}': {error.message}" if where else error.message


def _reason(e: BaseException) -> str:
    """The innermost cause of an SDK failure (exception groups unwrapped), as `Type: message`."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _log_path(server: McpServer) -> Path:
    return LOG_DIR / f"{server.name}-{os.getpid()}.log"


def _log_hint(server: McpServer) -> str:
    return f" (its stderr: {_log_path(server)})" if server.command else ""
