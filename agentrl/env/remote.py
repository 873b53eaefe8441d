"""An agentrl env in another process: `RemoteEnv` plays it through its OpenEnv server, and `EnvServer` runs that
server in the env's own virtualenv (`agentrl.env.venvs`), for an env registered with `venv=Venv(...)`.

Why OpenEnv's protocol: `agentrl serve env` already speaks it, one WebSocket session per episode with an env
instance of its own, so one server serves every concurrent episode of a job, and other trainers can use the same
server. What an episode does not cover (the task list, tools, the gold check, demonstrations) is plain HTTP beside
it (`agentrl/env/adapters/openenv_server.py`).

The server is started on first use, once per (virtualenv, env class, keyword arguments), and ends with the job:
at exit, and also when the job is SIGKILLed (`agentrl.system.lifetime.ProcessGroup`'s watchdog). A server that
died is started again on the next episode; the episodes it was playing end as `error`, with its log's last lines.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import subprocess
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

import httpx

from agentrl.env.api import TextEnv
from agentrl.env.venvs import Venv, ensure, interpreter
from agentrl.system.lifetime import ProcessGroup
from agentrl.types import Message, Task, ToolCall


STARTUP_TIMEOUT = 300.0  # seconds for a server to listen: its env's constructor may build an index


class RemoteEnvError(RuntimeError):
    """The env's server could not start, died, or runs another agentrl than this one."""


class RemoteEnv(TextEnv):
    """The agentrl env served at `url` (`agentrl serve env`, or an `EnvServer`), its whole `TextEnv` API."""

    def __init__(self, url: str, split: str = "train", server: EnvServer | None = None):
        try:
            from openenv.core import GenericEnvClient
        except ImportError as e:
            raise ImportError("a remote env needs `pip install --no-deps openenv 'fastmcp>=4' websockets` "
                              "(or make setup-adapters)") from e
        self.url, self.server = url.rstrip("/"), server
        spec = self._call(describe, self.url, split)
        super().__init__(split=split, max_turns=spec["max_turns"])
        self.max_reward, self._spec = spec["max_reward"], spec
        self._index = {task["id"]: i for i, task in enumerate(spec["tasks"])}
        self._client_cls, self.client = GenericEnvClient, None
        self._first: list[Message] = []

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return self._spec["tools"]

    def load_tasks(self, split: str) -> Sequence[Task]:
        return [Task(t["id"], t["data"], split) for t in self._spec["tasks"]]

    def difficulty(self, task: Task) -> dict[str, Any]:
        return self._spec["tasks"][self._index[task.id]]["difficulty"]

    def on_reset(self, task: Task) -> None:
        self.close()
        self.client = self._client_cls(base_url=self.url).sync()
        self._call(self.client.connect)
        result = self._call(self.client.reset, seed=0, task_index=self._index[task.id], split=self.split)
        self._first = _messages(result.observation["messages"])

    def first_messages(self, task: Task) -> Sequence[Message]:
        return tuple(self._first)

    def act(self, action: str):
        result = self._call(self.client.step, {"text": action})
        meta = result.observation["metadata"]
        info = {**meta["info"], "assistant": _messages([meta["assistant"]])[0]}
        return _messages(result.observation["messages"]), float(result.reward or 0.0), meta["terminated"], info

    def gold_actions(self, task: Task) -> list[str]:
        return self.demonstration(task, rng=None)

    def demonstration(self, task: Task, rng: Any, error_rate: float = 0.0) -> list[str]:
        seed = rng.randrange(2**31) if rng is not None else 0
        body = {"split": self.split, "task_index": self._index[task.id], "seed": seed, "error_rate": error_rate}
        return self._post("/agentrl/demonstration", body)["actions"]

    def validate(self, n_tasks: int = 8, tasks: Sequence[Task] | None = None) -> list[str]:
        """The env's own check, run by its server: the gold solutions there, played in the env's own process."""
        if tasks is not None:
            raise ValueError("a remote env validates its first n_tasks tasks only")
        return self._post("/agentrl/check", {"split": self.split, "n": n_tasks})["problems"]

    def close(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            client.close()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self._call(httpx.post, self.url + path, json=body, timeout=600.0)
        if response.status_code != 200:
            raise RemoteEnvError(f"{self.url}{path}: {response.status_code} {response.text[:500]}")
        return response.json()

    def _call(self, fn, *args: Any, **kwargs: Any) -> Any:
        """`fn(...)`; a failure while the server is dead says so, with its log's tail."""
        try:
            return fn(*args, **kwargs)
        except RemoteEnvError:
            raise
        except Exception as e:  # the server's transport: httpx's, websockets', OpenEnv's own errors
            if self.server is not None and self.server.ended(within=2.0):
                raise RemoteEnvError(f"the env server died ({self.server.describe_exit()})") from e
            raise


@functools.lru_cache(maxsize=64)
def describe(url: str, split: str) -> dict[str, Any]:
    """The env's static side (tasks, tools, max_reward, max_turns), once per server and split."""
    response = httpx.get(f"{url}/agentrl/env", params={"split": split}, timeout=600.0)
    if response.status_code == 404:
        raise RemoteEnvError(f"{url} is not an agentrl env server (no /agentrl/env): for another OpenEnv server "
                             "use openenv/remote-v0")
    response.raise_for_status()
    spec = response.json()
    if spec["version"] != metadata.version("agentrl"):
        raise RemoteEnvError(f"the env server at {url} runs agentrl {spec['version']}, this process "
                             f"{metadata.version('agentrl')}: install the same agentrl on both sides")
    return spec


def _messages(dicts: list[dict[str, Any]]) -> list[Message]:
    """The server's messages (`dataclasses.asdict` of each) as `Message`s again."""
    return [Message(m["role"], m["content"], tuple(ToolCall(**c) for c in m["tool_calls"]), m["tool_call_id"],
                    m["name"]) for m in dicts]


class EnvServer:
    """`entry_point`'s envs (made with `kwargs`) served from `python` on a free port of 127.0.0.1."""

    def __init__(self, python: Path, entry_point: str, kwargs: dict[str, Any], name: str, log_path: Path,
                 startup_timeout: float = STARTUP_TIMEOUT):
        self.command = [str(python), "-m", "agentrl.env.adapters.openenv_server", "--entry-point", entry_point,
                        "--kwargs", json.dumps(kwargs), "--name", name]
        self.log_path, self.startup_timeout, self.url = log_path, startup_timeout, ""
        self.group: ProcessGroup | None = None

    def start(self) -> EnvServer:
        """Start the server and wait until it listens (the port it prints)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        port_file = self.log_path.with_suffix(".port")
        port_file.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== agentrl: {' '.join(self.command)}\n".encode())
            log.flush()
            self.group = ProcessGroup([*self.command, "--port-file", str(port_file)], stdout=log, stderr=log)
        deadline = time.monotonic() + self.startup_timeout
        while not port_file.exists() or not port_file.read_text().endswith("\n"):
            if not self.alive() or time.monotonic() > deadline:
                why = self.describe_exit() if not self.alive() else f"not listening after {self.startup_timeout:.0f} s"
                self.stop()
                raise RemoteEnvError(f"the env server did not start: {why}")
            time.sleep(0.1)
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}"
        return self

    def alive(self) -> bool:
        """Whether the server's process is running."""
        return self.group is not None and self.group.process.poll() is None

    def ended(self, within: float) -> bool:
        """Whether the server's process has ended or ends within `within` s: a dying process closes its sockets
        before it can be reaped, so a broken connection can come a moment before the exit."""
        if self.group is None:
            return True
        try:
            self.group.process.wait(timeout=within)
        except subprocess.TimeoutExpired:
            return False
        return True

    def describe_exit(self) -> str:
        """How the server ended: its exit code and its log's last lines."""
        code = self.group.process.poll() if self.group else None
        tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])
        return f"exit code {code}; log {self.log_path}:\n{tail}"

    def stop(self) -> None:
        """SIGTERM the server, SIGKILL it after 10 s; idempotent."""
        group, self.group = self.group, None
        if group is not None:
            group.stop(timeout=10.0)


_servers: dict[str, EnvServer] = {}
_servers_lock = threading.Lock()


def make_remote(name: str, entry_point: str, venv: Venv, kwargs: dict[str, Any]) -> RemoteEnv:
    """An env of `entry_point` in its own virtualenv: the venv made once, its server started once per job (again
    if it died), and a `RemoteEnv` on it."""
    kwargs = dict(kwargs)
    split = kwargs.pop("split", "train")
    try:
        key = json.dumps([venv.python, venv.requirements, entry_point, kwargs], sort_keys=True)
    except TypeError as e:
        raise TypeError(f"{name} runs in its own virtualenv: its keyword arguments must be JSON values ({e})") from e
    with _servers_lock:
        server = _servers.get(key)
        if server is None or not server.alive():
            folder = ensure(venv)
            log = folder.parent / "logs" / f"{name.replace('/', '_')}-{os.getpid()}-{len(_servers)}.log"
            server = _servers[key] = EnvServer(interpreter(folder), entry_point, kwargs, name, log,
                                               STARTUP_TIMEOUT).start()
    return RemoteEnv(server.url, split, server)


@atexit.register
def stop_servers() -> None:
    """Stop every env server this process started."""
    with _servers_lock:
        for server in _servers.values():
            server.stop()
        _servers.clear()
