"""A Harbor task's box: a Docker container of the task's image, with a writable root filesystem, as Harbor runs it.

Unlike the code sandbox (`agentrl/tools/sandbox`), a task's box is the task's own image, root included: a task
installs packages, writes anywhere, starts servers that later commands use. Each command runs in a fresh
`bash -c` in the working directory, under coreutils' `timeout` (SIGKILL 5 s after the TERM); processes it leaves in
the background live on. The box has no network unless asked for (`network=True`), a memory limit (no swap) and
a process limit. Its PID 1 is `cat` reading this process's attach socket: when this process dies, even by
SIGKILL, the socket closes, `cat` exits and Docker removes the container.

Images: `build(context, dockerfile)` builds once per content (the tag is its hash). Offline, a `FROM` image that
is neither local nor pullable is replaced by `base_image` (agentrl's Debian base, `containers/build-base.sh`),
and the build says so; a `COPY --from=` of such an image cannot be replaced and fails with Docker's message.
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
import tarfile
import tempfile
import threading
from pathlib import Path, PurePosixPath
from typing import Any

from agentrl.tools.sandbox import RunResult, SandboxError
from agentrl.tools.sandbox.docker_runtime import BASE_IMAGE, LABEL, client, owner, remove
from agentrl.tools.sandbox.runner import Capture

log = logging.getLogger(__name__)
OUTPUT_BYTES = 16_000  # what a command's output keeps: head and tail, the cut marked
_build_lock = threading.Lock()  # one build at a time in this process: episodes of one task share its image


def build(context: Path, dockerfile: Path, base_image: str = BASE_IMAGE, docker_client: Any = None) -> str:
    """The image of `dockerfile` in `context`, built unless its tag (a hash of both) exists; returns the tag."""
    c = docker_client or client()
    files = sorted(p for p in context.rglob("*") if p.is_file())
    digest = hashlib.sha256(dockerfile.read_bytes() + base_image.encode())
    for p in files:
        digest.update(str(p.relative_to(context)).encode() + b"\0" + p.read_bytes())
    tag = f"agentrl/harbor:{digest.hexdigest()[:16]}"
    with _build_lock:
        if c.images.list(name=tag):
            return tag
        text = offline_from(dockerfile.read_text(), lambda image: _available(c, image), base_image)
        with tempfile.NamedTemporaryFile("w", suffix=".Dockerfile") as f:
            f.write(text)
            f.flush()
            try:
                c.images.build(path=str(context), dockerfile=f.name, tag=tag, rm=True)
            except Exception as e:  # docker-py's BuildError and APIError both carry Docker's reason
                raise SandboxError(f"building {dockerfile} failed: {e}") from e
    return tag


def remove_image(image: str, docker_client: Any = None) -> None:
    """Removes an image (a committed final state); one already gone is fine."""
    try:
        (docker_client or client()).images.remove(image, force=True)
    except Exception:  # noqa: BLE001 -- docker-py's ImageNotFound
        pass


def offline_from(dockerfile: str, available, base_image: str) -> str:
    """`dockerfile` with each `FROM` image that `available(image)` denies replaced by `base_image` (stage names
    and `ARG`-named images are kept)."""
    stages, lines = set(), []
    for line in dockerfile.splitlines():
        match = re.match(r"(\s*FROM\s+(?:--platform=\S+\s+)?)(\S+)(.*)", line, re.IGNORECASE)
        if match:
            head, image, rest = match.groups()
            if image.lower() not in stages and "$" not in image and not available(image):
                log.warning("%s cannot be pulled here: building FROM %s instead", image, base_image)
                line = f"{head}{base_image}{rest}"
            if stage := re.search(r"\bAS\s+(\S+)", rest, re.IGNORECASE):
                stages.add(stage.group(1).lower())
        lines.append(line)
    return "\n".join(lines) + "\n"


def _available(c: Any, image: str) -> bool:
    if c.images.list(name=image):
        return True
    try:
        c.images.pull(image)
        return True
    except Exception:  # noqa: BLE001 -- offline: no registry answers (docker-py's APIError, or a DNS failure)
        return False


class Box:
    """A container of `image`; `start()` it, `run` commands, `read`/`write` files, `commit` its state, `close()`."""

    def __init__(self, image: str, workdir: str = "", user: str = "", env: dict[str, str] | None = None,
                 memory_mb: int = 2048, cpus: float = 1.0, pids: int = 512, network: bool = False,
                 docker_client: Any = None):
        self.image, self.workdir, self.user, self.env = image, workdir, user, dict(env or {})
        self.memory_mb, self.cpus, self.pids, self.network = memory_mb, cpus, pids, network
        self._client, self.container, self._sock = docker_client, None, None

    def start(self) -> Box:
        """Creates and starts the container; idempotent."""
        if self.container is not None:
            return self
        c = self._client = self._client or client()
        host_config = c.api.create_host_config(
            auto_remove=True, network_mode="bridge" if self.network else "none", mem_limit=f"{self.memory_mb}m",
            memswap_limit=f"{self.memory_mb}m", nano_cpus=int(self.cpus * 1e9), pids_limit=self.pids)
        created = c.api.create_container(self.image, entrypoint=["cat"], command=[], labels={LABEL: owner()},
                                         stdin_open=True, tty=False, host_config=host_config,
                                         working_dir=self.workdir or None, environment=self.env)
        self.container = c.containers.get(created["Id"])
        self._sock = self.container.attach_socket(params={"stdin": 1, "stream": 1})
        self.container.start()
        return self

    def run(self, command: str, timeout: float, user: str | None = None, env: dict[str, str] | None = None,
            output_bytes: int = OUTPUT_BYTES) -> RunResult:
        """`command` in a fresh bash in the working directory, killed after `timeout` s; SandboxError if the box
        is gone."""
        argv = ["timeout", "-k", "5", str(int(timeout)), "bash", "-c", command]
        try:
            code, (out, err) = self._container().exec_run(argv, user=user if user is not None else self.user,
                                                          environment=env, workdir=self.workdir or None, demux=True)
        except SandboxError:
            raise
        except Exception as e:  # noqa: BLE001 -- docker-py's errors: the container died or was removed
            raise SandboxError(f"the task's box is gone ({e})") from e
        stdout, stderr = Capture(output_bytes // 2), Capture(output_bytes // 2)
        stdout.add(out or b"")
        stderr.add(err or b"")
        timed_out = code in (124, 137)
        return RunResult(None if timed_out else code, stdout.text(), stderr.text(), timed_out,
                         stdout.truncated or stderr.truncated, float(timeout) if timed_out else 0.0)

    def read(self, path: str) -> str:
        """A file's text (bad bytes replaced); OSError if there is no such file."""
        try:
            stream, _ = self._container().get_archive(self._absolute(path))
        except SandboxError:
            raise
        except Exception as e:  # noqa: BLE001 -- docker-py's NotFound
            raise OSError(f"no file {path}") from e
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            member = tar.next()
            if member is None or not member.isfile():
                raise OSError(f"{path} is not a file")
            return tar.extractfile(member).read().decode("utf-8", "replace")

    def write(self, path: str, content: str | bytes, mode: int = 0o644) -> None:
        """Creates or replaces a file, making its folders (owned by the box's user)."""
        target = PurePosixPath(self._absolute(path))
        self.run(f"mkdir -p '{target.parent}'", timeout=30)
        data = content.encode() if isinstance(content, str) else content
        self.put(str(target.parent), {target.name: (data, mode)})

    def put(self, folder: str, files: dict[str, tuple[bytes, int]]) -> None:
        """Files (relative name: (bytes, mode)) into an existing folder."""
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for name, (data, mode) in files.items():
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(data), mode
                tar.addfile(info, io.BytesIO(data))
        if not self._container().put_archive(folder, buffer.getvalue()):
            raise OSError(f"cannot write into {folder}")

    def copy_to(self, other: Box, path: str) -> bool:
        """`path` (a file or a folder) from this box into `other` at the same place; False if it does not exist."""
        path = self._absolute(path)
        try:
            stream, _ = self._container().get_archive(path)
        except Exception:  # noqa: BLE001 -- docker-py's NotFound
            return False
        parent = str(PurePosixPath(path).parent)
        other.run(f"mkdir -p '{parent}'", timeout=30, user="root")
        return other._container().put_archive(parent, b"".join(stream))

    def commit(self) -> str:
        """An image of the box's filesystem now (the caller removes it)."""
        return self._container().commit(changes=["LABEL agentrl.harbor=final-state"]).id

    def close(self) -> None:
        """Removes the container; idempotent."""
        container, self.container, sock, self._sock = self.container, None, self._sock, None
        remove(container, sock)

    def _container(self):
        if self.container is None:
            raise SandboxError("the task's box is not running: start() it")
        return self.container

    def _absolute(self, path: str) -> str:
        return str(PurePosixPath(self.workdir or "/") / path)
