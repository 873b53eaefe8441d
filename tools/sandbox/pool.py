"""A warm pool of sandboxes: started ahead, reset between episodes, health-checked, bounded, never leaked.

    pool = SandboxPool(lambda: DockerRuntime(limits), size=8)   # starts warming `size` in the background
    with pool.lease() as sandbox:                               # a started, empty sandbox
        sandbox.run(code="print(1)")
    # on release: reset (every process killed, workspace emptied); a sandbox that fails its reset or its
    # health check is closed and replaced. At most `size` exist at once; `close()` (also at exit) ends all.

`shared_pool(kind, limits)` is the pool of this process for envs, which are made per episode.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from agentrl.tools.sandbox.runtime import Limits, LocalRuntime, Runtime, SandboxError


class SandboxPool:
    """At most `size` sandboxes made by `make`, leased one at a time; `warm` starts them ahead in a thread."""

    def __init__(self, make: Callable[[], Runtime], size: int = 8, warm: bool = True):
        if size < 1:
            raise ValueError(f"pool size must be >= 1, got {size}")
        self._make, self.size = make, size
        self._idle: queue.Queue[Runtime] = queue.Queue()
        self._lock = threading.Lock()
        self._created, self._leased, self._closed = 0, set(), False
        self.replaced = 0  # sandboxes found broken and replaced
        atexit.register(self.close)
        if warm:
            threading.Thread(target=self._warm, name="agentrl-sandbox-warm", daemon=True).start()

    def _reserve(self) -> bool:
        with self._lock:
            if self._closed or self._created >= self.size:
                return False
            self._created += 1
            return True

    def _new(self) -> Runtime:
        """Creates and starts one sandbox; the caller has reserved its slot."""
        try:
            runtime = self._make()
            runtime.start()
            return runtime
        except BaseException:
            with self._lock:
                self._created -= 1
            raise

    def _warm(self) -> None:
        while self._reserve():
            try:
                self._idle.put(self._new())
            except Exception:  # noqa: BLE001 -- acquire() will try again and report the error
                return

    def acquire(self, timeout: float = 300.0) -> Runtime:
        """A started, healthy, empty sandbox; waits up to `timeout` s when all `size` are leased."""
        deadline = time.monotonic() + timeout
        while True:
            if self._closed:
                raise SandboxError("the sandbox pool is closed")
            try:
                runtime = self._idle.get_nowait()
            except queue.Empty:
                if self._reserve():
                    runtime = self._new()
                else:
                    try:
                        runtime = self._idle.get(timeout=max(deadline - time.monotonic(), 0.0))
                    except queue.Empty:
                        raise SandboxError(f"all {self.size} sandboxes stayed busy for {timeout:.0f} s") from None
            if runtime.healthy():
                with self._lock:
                    self._leased.add(runtime)
                return runtime
            self._discard(runtime)

    def release(self, runtime: Runtime) -> None:
        """Takes a leased sandbox back: reset for the next lease, or closed if its reset fails or the pool is closed."""
        with self._lock:
            self._leased.discard(runtime)
        if self._closed:
            runtime.close()
            return
        try:
            runtime.reset()
        except SandboxError:
            self._discard(runtime)
            return
        self._idle.put(runtime)

    @contextmanager
    def lease(self, timeout: float = 300.0) -> Iterator[Runtime]:
        """`acquire()` as a context manager: the sandbox is released on exit."""
        runtime = self.acquire(timeout)
        try:
            yield runtime
        finally:
            self.release(runtime)

    def _discard(self, runtime: Runtime) -> None:
        runtime.close()
        with self._lock:
            self._created -= 1
            self.replaced += 1

    def close(self) -> None:
        """Closes every sandbox, idle or leased. Idempotent."""
        with self._lock:
            self._closed = True
            leased, self._leased = list(self._leased), set()
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                break
        for runtime in leased:
            runtime.close()


_POOLS: dict[tuple, SandboxPool] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(kind: str = "docker", limits: Limits = Limits(), size: int = 8,
                image: str | None = None) -> SandboxPool:
    """This process's pool of `kind` ("docker" or "local") sandboxes with these limits (and Docker image:
    default the Python sandbox image), made on first use. Docker containers left by dead processes of this
    host are removed first."""
    with _POOLS_LOCK:
        key = (kind, limits, image)
        if key not in _POOLS or _POOLS[key]._closed:
            _POOLS[key] = SandboxPool(_factory(kind, limits, image), size)
        return _POOLS[key]


def _factory(kind: str, limits: Limits, image: str | None) -> Callable[[], Runtime]:
    if kind == "local":
        if image is not None:
            raise ValueError("a local sandbox has no image: use kind='docker'")
        return lambda: LocalRuntime(limits)
    if kind != "docker":
        raise ValueError(f"sandbox kind must be 'docker' or 'local', got {kind!r}")
    from agentrl.tools.sandbox.docker_runtime import DockerRuntime, build_image, cleanup_stale, client

    docker_client = client()
    cleanup_stale(docker_client)
    image = image or build_image(docker_client=docker_client)
    return lambda: DockerRuntime(limits, image=image, docker_client=docker_client)
