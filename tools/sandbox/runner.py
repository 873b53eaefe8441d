"""The runner kept alive inside each sandbox container: it executes what the host sends over its stdin.

Standard library only: it is copied into the image and runs as the container's PID 1 under the sandbox
user. One JSON request per line on stdin, one JSON reply per line on stdout:

    {"op": "run", "argv": [...] | "code": "...", "stdin": "", "timeout": 10, "max_output": 16000}
    {"op": "write", "path": "a.py", "data": "<base64>"}     {"op": "read", "path": "a.py", "max_bytes": N}
    {"op": "reset"}   (kill every process, empty the workspace, $AGENTRL_SCRATCH and System V IPC, put back the
                       runner's own limits and scheduling; reply with the memory still in use)  {"op": "ping"}

A `docker exec` per call costs 0.1 s; a line over an open pipe costs microseconds. After every run all other
processes in the container are killed (as PID 1, `kill(-1, SIGKILL)` reaches every process of the
namespace but the runner itself), so nothing a run starts outlives it. The runner exits when stdin closes:
a host that dies takes its containers with it.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import time

WORKSPACE = os.environ.get("AGENTRL_WORKSPACE", "/workspace")
# Other folders a reset empties (":"-separated): the container's /tmp, /dev/shm and POSIX message queues, so
# nothing passes to the next episode.
SCRATCH = [d for d in os.environ.get("AGENTRL_SCRATCH", "").split(":") if d]
# The name a Python program runs under, for its tracebacks; the source is never on disk, where the program
# could have put a directory or a FIFO first.
PROGRAM = "/tmp/agentrl_main.py"


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
        """Counts `data` and keeps it: the head fills first, then the tail keeps the latest bytes."""
        self.total += len(data)
        room = self.half - len(self.head)
        if room > 0:
            self.head, data = self.head + data[:room], data[room:]
        if data:
            self.tail = (self.tail + data)[-self.half:]

    @property
    def truncated(self) -> bool:
        """Whether bytes were dropped between the head and the tail."""
        return self.total > len(self.head) + len(self.tail)

    def text(self) -> str:
        """The stream as text (bad UTF-8 replaced), with a line saying how many bytes were cut, if any."""
        if not self.truncated:
            return (self.head + self.tail).decode("utf-8", "replace")
        dropped = self.total - len(self.head) - len(self.tail)
        return (self.head.decode("utf-8", "replace") + f"\n[... {dropped} bytes of output truncated ...]\n"
                + self.tail.decode("utf-8", "replace"))


class Forked:
    """A Python program run in a fork of this (already started) interpreter, with the `subprocess.Popen`
    surface `run` needs. A fresh `python3` costs ~10 ms of start-up; a fork ~1 ms. The child gets its own
    session, standard streams, `__main__` module and argv, so the program runs as it would as a script."""

    def __init__(self, code: str, path: str, cwd: str, setup):
        (in_r, in_w), (out_r, out_w), (err_r, err_w) = fds = os.pipe(), os.pipe(), os.pipe()
        try:
            self.pid, self.returncode = os.fork(), None
        except OSError:  # EAGAIN: a process limit; the runner lives on, the pipes closed
            for fd in (fd for pair in fds for fd in pair):
                os.close(fd)
            raise
        if self.pid == 0:  # the child: never returns
            status = 1
            try:
                os.setsid()
                os.chdir(cwd)
                setup()
                for fd, target in ((in_r, 0), (out_w, 1), (err_w, 2)):
                    os.dup2(fd, target)
                os.closerange(3, 1 << 16)  # the host channel and every pipe of the runner
                status = _exec_main(code, path)
            finally:
                os._exit(status)
        for fd in (in_r, out_w, err_w):
            os.close(fd)
        self.stdin, self.stdout, self.stderr = os.fdopen(in_w, "wb"), os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb")

    def poll(self) -> int | None:
        """As `Popen.poll`: the child's exit code (the negative signal number if killed), or None while it runs."""
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        """As `Popen.wait`: the child's exit code; `subprocess.TimeoutExpired` after `timeout` s."""
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.001)
        return self.returncode


def _exec_main(code: str, path: str) -> int:
    """In the forked child: run `code` as the `__main__` script at `path`; its exit status."""
    import io
    import linecache
    import traceback
    import types

    linecache.cache[path] = (len(code), None, code.splitlines(True), path)  # tracebacks show the source

    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r"))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w"), write_through=True)  # unbuffered, as python3 -u
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w"), write_through=True)
    main = types.ModuleType("__main__")
    main.__file__, sys.argv, sys.modules["__main__"] = path, [path], main
    try:
        exec(compile(code, path, "exec"), main.__dict__)
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:  # noqa: BLE001 -- reported as Python reports an uncaught exception
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # without this frame
        return 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except OSError:
                pass


class HostGone(Exception):
    """The host closed the runner's stdin during a run."""


def run(argv: list[str] | None, stdin: str, timeout: float, max_output: int, kill_all, cwd: str = WORKSPACE,
        setup=_child_setup, host=None, code: str | None = None) -> dict:
    """Runs argv, or Python `code` in a fork of this interpreter (single-threaded callers only), in `cwd` with
    a wall-clock timeout; `kill_all(proc)` ends it and anything it started. `setup` runs in the child first.
    `stdin` is fed as the program reads it, under the same deadline. `host`: a file whose EOF means the host
    is gone (raises HostGone). A program that cannot start (an argument over the kernel's 128 KiB, or with a NUL
    byte) is a result with exit code 126 and the reason, as a shell reports it."""
    start = time.monotonic()
    try:
        proc = Forked(code, PROGRAM, cwd, setup) if code is not None else subprocess.Popen(
            argv, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            preexec_fn=setup, start_new_session=True)
    except (OSError, ValueError) as e:  # E2BIG, ENOENT; a NUL byte in an argument
        reason = getattr(e, "strerror", None) or str(e)
        program = "python" if code is not None else argv[0]  # a fork of this interpreter has no argv
        return {"ok": True, "exit_code": 126, "stdout": "", "stderr": f"cannot run {program!r}: {reason}",
                "timed_out": False, "truncated": False, "seconds": round(time.monotonic() - start, 4)}
    streams = {proc.stdout: Capture(max_output // 2), proc.stderr: Capture(max_output // 2)}
    sel = selectors.DefaultSelector()
    for pipe in streams:
        os.set_blocking(pipe.fileno(), False)
        sel.register(pipe, selectors.EVENT_READ)
    pending = memoryview(stdin.encode())
    if pending:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
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
            if key.fileobj is proc.stdin:
                pending = _feed(proc.stdin, pending)
                if not pending:
                    sel.unregister(proc.stdin)
                    proc.stdin.close()
                continue
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
    if not proc.stdin.closed:
        proc.stdin.close()
    out, err = streams[proc.stdout], streams[proc.stderr]
    return {"ok": True, "exit_code": exit_code, "stdout": out.text(), "stderr": err.text(), "timed_out": timed_out,
            "truncated": out.truncated or err.truncated, "seconds": round(time.monotonic() - start, 4)}


def _feed(pipe, data: memoryview) -> memoryview:
    """Writes what the pipe takes now; the rest. A program that closed its stdin takes nothing more."""
    try:
        return data[os.write(pipe.fileno(), data[:65536]):]
    except BlockingIOError:
        return data
    except BrokenPipeError:
        return data[:0]


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


def _open_file(path: str, flags: int) -> int:
    """A workspace file's descriptor, opened without blocking (a FIFO would hang the runner); OSError if it is
    not a regular file."""
    fd = os.open(_inside(path), flags | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise IsADirectoryError(f"{path} is not a regular file")
    os.set_blocking(fd, True)
    return fd


def empty_ipc() -> None:
    """Removes every System V shared memory segment, message queue and semaphore set of the container's IPC
    namespace: they outlive the processes that made them, with their data and their memory."""
    libc = ctypes.CDLL(None, use_errno=True)
    remove = {"shmid": lambda i: libc.shmctl(i, 0, None), "msqid": lambda i: libc.msgctl(i, 0, None),
              "semid": lambda i: libc.semctl(i, 0, 0)}  # 0: IPC_RMID
    for kind in ("shm", "msg", "sem"):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                header, *rows = [line.split() for line in f]
        except OSError:
            continue
        column = next(i for i, name in enumerate(header) if name in remove)
        for row in rows:
            remove[header[column]](int(row[column]))


def memory_in_use() -> int | None:
    """Bytes of the container's memory held by processes and by memory-backed files (anonymous + shmem), from
    its cgroup (v2 or v1); None where neither can be read."""
    for path, anon in (("/sys/fs/cgroup/memory.stat", "anon"), ("/sys/fs/cgroup/memory/memory.stat", "rss")):
        try:
            with open(path) as f:
                stats = dict(line.split() for line in f)
        except OSError:
            continue
        return int(stats.get(anon, 0)) + int(stats.get("shmem", 0))
    return None


RLIMITS = sorted({getattr(resource, name) for name in dir(resource) if name.startswith("RLIMIT_")})


def own_state() -> dict:
    """What code run here can change about the runner itself: as the same user it reaches PID 1 with prlimit,
    setpriority, sched_setaffinity and sched_setscheduler, and every later fork would inherit the change."""
    return {"rlimits": {r: resource.getrlimit(r) for r in RLIMITS}, "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "affinity": os.sched_getaffinity(0), "scheduler": os.sched_getscheduler(0)}


def restore(state: dict) -> None:
    """Puts back what `own_state` read at start; a RuntimeError naming what cannot be (a hard limit lowered, a
    priority lowered: raising either back needs a capability the sandbox does not have), so that the host
    replaces the container."""
    failed = []
    for r, limits in state["rlimits"].items():
        if resource.getrlimit(r) != limits:
            try:
                resource.setrlimit(r, limits)
            except (ValueError, OSError):
                failed.append(f"rlimit {r} {resource.getrlimit(r)} (was {limits})")
    steps = {"nice": lambda: os.setpriority(os.PRIO_PROCESS, 0, state["nice"]),
             "affinity": lambda: os.sched_setaffinity(0, state["affinity"]),
             "scheduler": lambda: os.sched_setscheduler(0, state["scheduler"], os.sched_param(0))}
    now = own_state()
    for name, put_back in steps.items():
        if now[name] != state[name]:
            try:
                put_back()
            except OSError:
                failed.append(f"{name} {now[name]} (was {state[name]})")
    if failed:
        raise RuntimeError(f"a run changed the runner's own {', '.join(failed)}, which cannot be put back")


START = own_state()


def handle(req: dict) -> dict:
    """Carries out one request and returns its reply.

    Exceptions propagate: `main` turns them into error replies (HostGone ends the runner).
    """
    op = req.get("op")
    if op == "ping":
        return {"ok": True}
    if op == "run":
        return run(req.get("argv"), req.get("stdin", ""), float(req.get("timeout", 10)),
                   int(req.get("max_output", 16000)), kill_everything_else, host=sys.stdin, code=req.get("code"))
    if op == "write":
        os.makedirs(os.path.dirname(_inside(req["path"])), exist_ok=True)
        with os.fdopen(_open_file(req["path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:
            f.write(base64.b64decode(req["data"]))
        return {"ok": True}
    if op == "read":
        with os.fdopen(_open_file(req["path"], os.O_RDONLY), "rb") as f:
            data = f.read(int(req.get("max_bytes", 1 << 20)))
        return {"ok": True, "data": base64.b64encode(data).decode()}
    if op == "reset":
        kill_everything_else()
        for folder in (WORKSPACE, *SCRATCH):
            for name in os.listdir(folder):
                path = os.path.join(folder, name)
                shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
        empty_ipc()
        restore(START)
        return {"ok": True, "memory_bytes": memory_in_use()}
    return {"ok": False, "error": f"unknown op {op!r}"}


def main() -> None:
    """Serves one request per line of stdin until the host closes it; SIGINT and SIGTERM are ignored."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # only the host ends the runner: by closing stdin
        signal.signal(sig, signal.SIG_IGN)
    # Non-dumpable (PR_SET_DUMPABLE 0, inherited by the forks that run Python code, reset by exec): code run
    # here cannot open the runner's /proc files (its memory, the host channel) or a grader's.
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
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
