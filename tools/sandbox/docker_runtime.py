"""The Docker sandbox: one container per sandbox, with a runner process kept alive inside it.

Isolated: no network (`network_mode=none`); memory (no swap), CPU and pids limits; a read-only root
filesystem; size- and inode-limited tmpfs mounts for the workspace (`/workspace`), `/tmp` and `/dev/shm`, the
only writable places besides POSIX message queues; a private IPC namespace; an unprivileged user (uid 1000);
every capability dropped and `no-new-privileges`; a wall-clock timeout per run after which the runner kills
every process in the container (as PID 1 it can, and nothing can kill it: signals without a handler do
not reach a namespace's init); output cut to a budget. A reset empties every writable place and removes every
System V IPC object (shared memory outlives its processes, with its data); a container that still holds
over a quarter of its memory after that is replaced.
Not isolated: the kernel is shared with the host (a kernel exploit escapes; use gVisor or a VM runtime
through `runtime=` for hostile code), CPU time and memory bandwidth are shared, and the image's own
files are readable.

Every container carries the label `agentrl.sandbox` with its owner's host and pid. The runner exits when
its stdin closes, so containers end with the process that made them, even on SIGKILL; `cleanup_stale`
removes any left by a crashed daemon connection, by label.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

from agentrl.tools.sandbox.runtime import Limits, RunResult, SandboxError, run_result

LABEL = "agentrl.sandbox"
BASE_IMAGE = "agentrl/base:bookworm"
CONTAINERS = resources.files("agentrl.containers")  # the repository's containers/ folder, shipped as package data
DOCKERFILE = CONTAINERS / "python" / "Dockerfile"
START_TIMEOUT = 30.0  # seconds for a new container to answer its first ping
SCRATCH = "/tmp:/dev/shm:/dev/mqueue"  # emptied by every reset, beside the workspace


def client() -> Any:
    """A docker-py client, or a SandboxError that says how to get a daemon."""
    try:
        import docker
    except ImportError as e:
        raise SandboxError("the Docker sandbox needs docker-py: pip install 'agentrl[sandbox]'") from e
    try:
        c = docker.from_env()
        c.ping()
        return c
    except Exception as e:  # noqa: BLE001 -- docker-py raises several types for "no daemon"
        raise SandboxError(f"no Docker daemon answers ({e}); start one: {CONTAINERS / 'start-dockerd.sh'} "
                           "(or `sudo dockerd &`)") from e


def image_tag() -> str:
    """The Python sandbox image's tag: a hash of its Dockerfile and runner, so a change rebuilds it."""
    digest = hashlib.sha256(DOCKERFILE.read_bytes() + _runner_source()).hexdigest()[:12]
    return f"agentrl/python:{digest}"


def _runner_source() -> bytes:
    return resources.files("agentrl.tools.sandbox").joinpath("runner.py").read_bytes()


def build_image(base_image: str = BASE_IMAGE, docker_client: Any = None) -> str:
    """Builds the Python sandbox image FROM `base_image` unless it exists; returns its tag. Offline: the
    base image must be local (containers/build-base.sh builds one from Debian packages)."""
    c = docker_client or client()
    tag = image_tag()
    if c.images.list(name=tag):
        return tag
    if not c.images.list(name=base_image):
        raise SandboxError(f"base image {base_image} is missing: build it with {CONTAINERS / 'build-base.sh'} "
                           "(offline, from Debian packages) or pull a Debian/Ubuntu image with python3")
    with tempfile.TemporaryDirectory() as context:
        (Path(context) / "Dockerfile").write_bytes(DOCKERFILE.read_bytes())
        (Path(context) / "runner.py").write_bytes(_runner_source())
        c.images.build(path=context, tag=tag, buildargs={"BASE_IMAGE": base_image}, rm=True, network_mode="none")
    return tag


def owner() -> str:
    """This process as `host:pid`: the `agentrl.sandbox` label of its containers (see `cleanup_stale`)."""
    return f"{socket.gethostname()}:{os.getpid()}"


def cleanup_stale(docker_client: Any = None) -> int:
    """Removes sandbox containers whose owning process (on this host) is gone; returns how many."""
    c = docker_client or client()
    removed = 0
    for container in c.containers.list(all=True, filters={"label": LABEL}):
        host, _, pid = container.labels.get(LABEL, "").rpartition(":")
        if host == socket.gethostname() and pid.isdigit() and not _alive(int(pid)):
            container.remove(force=True)
            removed += 1
    return removed


def remove(container: Any, sock: Any) -> None:
    """Closes a container's attach socket and removes it (either may be None); one already gone is fine."""
    if sock is not None:
        try:
            sock.close()
        except OSError:
            pass
    if container is not None:
        try:
            container.remove(force=True)
        except Exception:  # noqa: BLE001 -- already gone (auto_remove) is fine
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class DockerRuntime:
    """A sandbox container and its runner; see the module docstring for what is and is not isolated."""

    def __init__(self, limits: Limits = Limits(), image: str | None = None, docker_client: Any = None,
                 runtime: str | None = None):
        self.limits, self.image, self.runtime = limits, image, runtime
        self._client, self.container, self._sock = docker_client, None, None
        self._buffer = b""

    def start(self) -> None:
        """Starts the container (building the image if needed) and waits for its runner to answer; idempotent."""
        if self.container is not None:
            return
        c = self._client = self._client or client()
        image = self.image or build_image(docker_client=c)
        lim = self.limits
        host_config = c.api.create_host_config(
            auto_remove=True, network_mode="none", mem_limit=f"{lim.memory_mb}m",
            memswap_limit=f"{lim.memory_mb}m", nano_cpus=int(lim.cpus * 1e9), pids_limit=lim.pids,
            read_only=True, ipc_mode="private", cap_drop=["ALL"], security_opt=["no-new-privileges"],
            # inodes bounded too: each costs kernel memory, and 700k empty files took the runner down
            tmpfs={"/workspace": f"size={lim.disk_mb}m,nr_inodes=65536,uid=1000,gid=1000,mode=0755",
                   "/tmp": "size=16m,nr_inodes=4096,mode=1777", "/dev/shm": "size=16m,nr_inodes=1024,mode=1777"},
            runtime=self.runtime)
        # The low-level API with stdin open and not detached sets StdinOnce: stdin closes when we detach,
        # the runner sees EOF and exits, and auto_remove deletes the container.
        created = c.api.create_container(image, labels={LABEL: owner()}, stdin_open=True, tty=False,
                                         user="1000:1000", network_disabled=True, host_config=host_config,
                                         environment={"AGENTRL_SCRATCH": SCRATCH})
        self.container = c.containers.get(created["Id"])
        self._sock = self.container.attach_socket(params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
        self.container.start()
        self._request({"op": "ping"}, START_TIMEOUT)

    def run(self, argv: Sequence[str] | None = None, *, code: str | None = None, stdin: str = "",
            timeout: float | None = None) -> RunResult:
        """Runs argv, or Python `code`, in the workspace (see `Runtime.run`); all it started is killed after."""
        if (argv is None) == (code is None):
            raise ValueError("run needs argv or code, not both")
        timeout = timeout or self.limits.timeout
        request = {"op": "run", "stdin": stdin, "timeout": timeout, "max_output": self.limits.output_bytes,
                   **({"code": code} if code is not None else {"argv": list(argv)})}
        return run_result(self._request(request, timeout + 10.0))

    def read(self, path: str) -> str:
        """A workspace file's first MiB, as UTF-8 (bad bytes replaced); OSError if the runner cannot read it."""
        reply = self._request({"op": "read", "path": path}, 30.0)
        return base64.b64decode(reply["data"]).decode("utf-8", "replace")

    def write(self, path: str, content: str | bytes) -> None:
        """Creates or replaces a workspace file (text as UTF-8), making its directories; OSError if the runner
        cannot."""
        data = content.encode() if isinstance(content, str) else content
        self._request({"op": "write", "path": path, "data": base64.b64encode(data).decode()}, 30.0)

    def reset(self) -> None:
        """Kills every process in the container, empties every writable place and IPC object; SandboxError if
        the container then still holds over a quarter of its memory (the pool replaces it)."""
        held = self._request({"op": "reset"}, 30.0).get("memory_bytes")
        if held is not None and held > (self.limits.memory_mb << 20) // 4:
            raise SandboxError(f"the sandbox still holds {held >> 20} MB of its {self.limits.memory_mb} MB after a "
                               "reset")

    def healthy(self) -> bool:
        """Whether the runner answers a ping within 5 s (a sandbox that does not is closed)."""
        try:
            self._request({"op": "ping"}, 5.0)
            return True
        except SandboxError:
            return False

    def close(self) -> None:
        """Closes the socket and removes the container; idempotent."""
        container, self.container, sock, self._sock = self.container, None, self._sock, None
        remove(container, sock)

    # --- the runner protocol over the attach socket -------------------------------------------------------

    def _request(self, request: dict, timeout: float) -> dict:
        if self.container is None:
            raise SandboxError("the sandbox is not running: start() it (a sandbox that died stays closed)")
        raw = self._sock._sock  # docker-py's SocketIO wraps the connection
        try:
            raw.sendall(json.dumps(request).encode() + b"\n")
            line = self._read_line(raw, time.monotonic() + timeout)
        except (OSError, SandboxError) as e:
            reason = self._death_reason()
            self.close()
            raise SandboxError(f"sandbox container died or hung ({e}; {reason})") from e
        reply = json.loads(line)
        if not reply.get("ok") and request["op"] in ("read", "write"):  # a bad path: the caller's mistake
            raise OSError(reply.get("error"))
        if not reply.get("ok"):
            raise SandboxError(f"sandbox runner: {reply.get('error')}")
        return reply

    def _read_line(self, raw: socket.socket, deadline: float) -> bytes:
        """Reads the runner's stdout frames (the stream is multiplexed: 8-byte headers) up to a newline."""
        while b"\n" not in self._buffer:
            header = self._read_exactly(raw, 8, deadline)
            payload = self._read_exactly(raw, int.from_bytes(header[4:8], "big"), deadline)
            if header[0] == 1:  # stdout; the runner's stderr (tracebacks) only matters if it dies
                self._buffer += payload
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    @staticmethod
    def _read_exactly(raw: socket.socket, n: int, deadline: float) -> bytes:
        data = b""
        while len(data) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SandboxError("no reply before the deadline")
            raw.settimeout(remaining)
            chunk = raw.recv(n - len(data))
            if not chunk:
                raise SandboxError("the runner closed its output")
            data += chunk
        return data

    def _death_reason(self) -> str:
        try:
            self.container.reload()
            state = self.container.attrs["State"]
            return f"container {state['Status']}, exit code {state['ExitCode']}, OOM-killed {state['OOMKilled']}"
        except Exception:  # noqa: BLE001
            return "container gone"
