"""The runner kept alive inside each sandbox container: it executes what the host sends over its stdin.

Standard library only: it is copied into the image and runs as the container's PID 1 under the sandbox
user. One JSON request per line on stdin, one JSON reply per line on stdout:

    {"op": "run", "argv": [...] | "code": "...", "stdin": "", "timeout": 10, "max_output": 16000}
    {"op": "write", "path": "a.py", "data": "<base64>"}     {"op": "read", "path": "a.py", "max_bytes": N}
    {"op": "reset"}   (kill every process, empty the workspace)      {"op": "ping"}

A `docker exec` per call costs 0.1 s; a line over an open pipe costs microseconds. After every run all other
processes in the container are killed (as PID 1, `kill(-1, SIGKILL)` reaches every process of the
namespace but the runner itself), so nothing a run starts outlives it. The runner exits when stdin closes:
a host that dies takes its containers with it.
"""

from __future__ import annotations

import base64
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time

WORKSPACE = os.environ.get("AGENTRL_WORKSPACE", "/workspace")


def _child_setup() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    try:  # under memory pressure the kernel should pick the child, not the runner
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


class Capture:
    """Head and tail of a stream within a byte budget, and the total size."""

    def __init__(self, budget: int):
        self.half, self.head, self.tail, self.total = max(budget // 2, 1), b"", b"", 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.half - len(self.head)
        if room > 0:
            self.head, data = self.head + data[:room], data[room:]
        if data:
            self.tail = (self.tail + data)[-self.half:]

    @property
    def truncated(self) -> bool:
        return self.total > len(self.head) + len(self.tail)

    def text(self) -> str:
        if not self.truncated:
            return (self.head + self.tail).decode("utf-8", "replace")
        dropped = self.total - len(self.head) - len(self.tail)
        return (self.head.decode("utf-8", "replace") + f"\n[... {dropped} bytes of output truncated ...]\n"
                + self.tail.decode("utf-8", "replace"))


class HostGone(Exception):
    """The host closed the runner's stdin during a run."""


def run(argv: list[str], stdin: str, timeout: float, max_output: int, kill_all, cwd: str = WORKSPACE,
        setup=_child_setup, host=None) -> dict:
    """Runs argv in `cwd` with a wall-clock timeout; `kill_all(proc)` ends it and anything it started.
    `setup` runs in the child before exec. `host`: a file whose EOF means the host is gone (HostGone)."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=setup, start_new_session=True)
    try:
        proc.stdin.write(stdin.encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    streams = {proc.stdout: Capture(max_output // 2), proc.stderr: Capture(max_output // 2)}
    sel = selectors.DefaultSelector()
    for pipe in streams:
        os.set_blocking(pipe.fileno(), False)
        sel.register(pipe, selectors.EVENT_READ)
    if host is not None:
        sel.register(host, selectors.EVENT_READ)
    deadline, exited_at, timed_out = start + timeout, None, False
    open_pipes = set(streams)
    while open_pipes:
        now = time.monotonic()
        if now >= deadline:
            timed_out = proc.poll() is None
            break
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        if exited_at is not None and now - exited_at > 0.2:  # background processes hold the pipes open
            break
        for key, _ in sel.select(timeout=min(0.05, deadline - now)):
            data = os.read(key.fileobj.fileno(), 65536)
            if key.fileobj is host:  # the host sends nothing during a run: this is its end
                kill_all(proc)
                raise HostGone()
            if data:
                streams[key.fileobj].add(data)
            else:
                sel.unregister(key.fileobj)
                open_pipes.discard(key.fileobj)
    if not timed_out:  # the pipes may close before the process ends
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            timed_out = True
    exit_code = None if timed_out else proc.returncode
    kill_all(proc)
    out, err = streams[proc.stdout], streams[proc.stderr]
    return {"ok": True, "exit_code": exit_code, "stdout": out.text(), "stderr": err.text(), "timed_out": timed_out,
            "truncated": out.truncated or err.truncated, "seconds": round(time.monotonic() - start, 4)}


def kill_everything_else(proc: subprocess.Popen | None = None) -> None:
    """As PID 1: every other process in the container, then reap them all."""
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
    while True:
        try:
            if os.waitpid(-1, 0)[0] == 0:
                break
        except ChildProcessError:
            break
    if proc is not None and proc.returncode is None:
        proc.returncode = -signal.SIGKILL


def _inside(path: str) -> str:
    full = os.path.realpath(os.path.join(WORKSPACE, path))
    if os.path.commonpath([full, os.path.realpath(WORKSPACE)]) != os.path.realpath(WORKSPACE):
        raise ValueError(f"{path!r} is outside the workspace")
    return full


def handle(req: dict) -> dict:
    op = req.get("op")
    if op == "ping":
        return {"ok": True}
    if op == "run":
        argv = req.get("argv")
        if "code" in req:
            path = "/tmp/agentrl_main.py"
            with open(path, "w") as f:
                f.write(req["code"])
            argv = [sys.executable, "-u", path]
        return run(argv, req.get("stdin", ""), float(req.get("timeout", 10)), int(req.get("max_output", 16000)),
                   kill_everything_else, host=sys.stdin)
    if op == "write":
        path = _inside(req["path"])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(req["data"]))
        return {"ok": True}
    if op == "read":
        with open(_inside(req["path"]), "rb") as f:
            data = f.read(int(req.get("max_bytes", 1 << 20)))
        return {"ok": True, "data": base64.b64encode(data).decode()}
    if op == "reset":
        kill_everything_else()
        for name in os.listdir(WORKSPACE):
            path = os.path.join(WORKSPACE, name)
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
        return {"ok": True}
    return {"ok": False, "error": f"unknown op {op!r}"}


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):  # only the host ends the runner: by closing stdin
        signal.signal(sig, signal.SIG_IGN)
    for line in sys.stdin:
        try:
            reply = handle(json.loads(line))
        except HostGone:
            return
        except Exception as e:  # noqa: BLE001 -- any failure is a reply, never the runner's death
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
