"""Processes that end with their owner, however it ends (SIGKILL and the OOM killer included).

    group = ProcessGroup(["vllm", "serve", ...], stdout=log)   # subprocess.Popen's arguments
    group.process                                             # the Popen of the command
    group.stop()                                              # SIGTERM the group, SIGKILL what is left
    owned(["node", "server.js"])    # the same, as a command line for code that spawns processes itself
    watchdog = Watchdog(grace=0)    # the watch alone, for groups started elsewhere (the local sandbox's runs)
    watchdog.watch(pgid)

The command leads a new session, so its process group holds everything it starts (vLLM's engine core) and a
Ctrl-C meant for the owner does not reach it. A watchdog, a few lines of Python in a session of their own,
polls its parent: when that is no longer the owner (the owner died and the watchdog was re-parented), it
SIGTERMs the groups it was given, waits `grace` seconds, and SIGKILLs what is left. It exits once its groups are
gone and it has been told that no more will come.

Why not `PR_SET_PDEATHSIG`: the kernel sends it when the *thread* that forked the child exits, and servers are
restarted from worker threads (`asyncio.to_thread`); it also reaches the group leader only, not its children.
A pipe the watchdog reads to EOF would stay open in any fork of the owner. The parent pid changes exactly
when the owner process is gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Run as `python -I -S -c`: no site, no agentrl import, so it starts in milliseconds and holds ~10 MB. It reads the
# process group ids to watch from stdin, one per line, until EOF.
_WATCHDOG = """
import os, select, signal, sys, time
owner, grace = int(sys.argv[1]), float(sys.argv[2])
groups, listening, pending = set(), True, b""
def signal_group(group, sig):
    try:
        os.killpg(group, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
while os.getppid() == owner:
    if not listening:
        time.sleep(0.25)
    elif select.select([0], [], [], 0.25)[0]:
        data = os.read(0, 4096)
        listening = bool(data)
        *lines, pending = (pending + data).split(b"\\n")
        groups.update(int(line) for line in lines if line.strip())
    groups = {group for group in groups if signal_group(group, 0)}
    if not listening and not groups:
        sys.exit(0)  # the groups ended on their own, and no more will come
for group in groups:
    signal_group(group, signal.SIGTERM)
deadline = time.monotonic() + grace
while any(signal_group(group, 0) for group in groups) and time.monotonic() < deadline:
    time.sleep(0.1)
for group in groups:
    signal_group(group, signal.SIGKILL)
"""


class Watchdog:
    """A small process that ends the process groups it is given when this process dies (see the module's doc).

    `grace`: seconds between the SIGTERM and the SIGKILL. `watch(group)` hands it a group; `close()` says no more
    will come, after which it exits once its groups have ended on their own.
    """

    def __init__(self, grace: float = 10.0):
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _WATCHDOG, str(os.getpid()), str(grace)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)  # not in the owner's group: a Ctrl-C there must not end the watch
        self._fd = self.process.stdin.fileno()

    def watch(self, group: int) -> None:
        """Ends process group `group` with this process. One write of a few bytes (atomic on a pipe): also safe in a
        forked child before it execs (a `preexec_fn`), where the child's own pid is its new group's id."""
        if self.process.stdin.closed:  # its descriptor number may belong to another file by now
            raise RuntimeError("this watchdog was closed: it takes no more groups")
        os.write(self._fd, b"%d\n" % group)

    def alive(self) -> bool:
        """Whether the watchdog is still running."""
        return self.process.poll() is None

    def close(self) -> None:
        """No more groups will come; idempotent."""
        if not self.process.stdin.closed:
            self.process.stdin.close()

    def kill(self) -> None:
        """Ends the watchdog now (its groups are gone); idempotent."""
        self.close()
        self.process.kill()
        self.process.wait()


# `owned`'s launcher: the command in a process group of its own, whose stdin/stdout it leaves to the command (so the
# pipes close when the command exits), ended with the owner, on SIGTERM, and when the command itself exits.
_LAUNCHER = """
import os, signal, subprocess, sys
owner, grace, args = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the owner's to handle; the owner ends this
child = subprocess.Popen(args, start_new_session=True)
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 0)
os.dup2(null, 1)
def signal_group(sig):
    try:
        os.killpg(child.pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
def end(*_):
    signal_group(signal.SIGTERM)
    try:
        child.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    signal_group(signal.SIGKILL)
    os._exit(child.poll() if child.poll() is not None else 1)
signal.signal(signal.SIGTERM, end)
while os.getppid() == owner:
    try:
        child.wait(0.25)
        end()
    except subprocess.TimeoutExpired:
        pass
end()
"""


def owned(args: Sequence[str], grace: float = 5.0) -> list[str]:
    """A command line that runs `args` as `ProcessGroup` would, for code that spawns the process itself (an SDK
    that takes a command): the process group of `args` ends when this process dies, when the launcher is sent
    SIGTERM, and when `args` exits (its own children with it). stdin, stdout and stderr pass through."""
    return [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(os.getpid()), str(grace), *args]


class ProcessGroup:
    """`args` run as the leader of a new process group that ends with this process (see the module's doc).

    `popen` are `subprocess.Popen`'s keyword arguments (`stdout`, `env`, ...); `grace` is how long the group
    gets between SIGTERM and SIGKILL when its owner has died.
    """

    def __init__(self, args: Sequence[str], grace: float = 10.0, **popen: Any):
        self.process = subprocess.Popen(args, start_new_session=True, **popen)
        self._ended = False  # the group is gone for good: its id, the leader's pid, may be another's now
        try:
            self._watchdog = Watchdog(grace)
            self._watchdog.watch(self.process.pid)
            self._watchdog.close()
        except BaseException:
            self._signal(signal.SIGKILL)
            self.process.wait()
            raise

    @property
    def pid(self) -> int:
        """The leader's pid, which is also the group's id."""
        return self.process.pid

    def alive(self) -> bool:
        """Whether any process of the group is left (the leader's children outlive it when it is killed alone)."""
        self.process.poll()  # reap the leader, or its zombie keeps the group alive
        return self._signal(0)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the group, wait up to `timeout` s for all of it to exit, SIGKILL what is left; idempotent. The
        leader's descendants that left the group for a session of their own (an agent CLI's shell tool starts each
        command so) are found through their parents first and SIGKILLed after."""
        escaped = self._escaped()
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:  # children release shared memory as they exit
            time.sleep(0.2)
        self._kill(escaped)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=timeout)
        self._watchdog.kill()  # the group is gone: nothing left to watch

    def kill(self) -> None:
        """SIGKILL the group and every descendant of its leader at once, with no time to clean up (nor to start more:
        the group is stopped first, SIGSTOP); idempotent."""
        self._signal(signal.SIGSTOP)
        self._kill(self._escaped())
        self.process.wait()
        self._watchdog.kill()

    def _escaped(self) -> list[int]:
        """The leader's descendants now that are not in its group (none once it is reaped: its children went to init,
        and its pid may be another process's)."""
        if self.process.poll() is not None:
            return []
        return [pid for pid in descendants(self.process.pid) if _group_of(pid) != self.process.pid]

    def _kill(self, escaped: list[int]) -> None:
        self._signal(signal.SIGKILL)
        for pid in escaped:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def _signal(self, sig: int) -> bool:
        if self._ended:  # pids are reused (pid_max may be 32768): the id may name an unrelated group by now
            return False
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:  # no member left, not even the leader's zombie: reaped, gone for good
            self._ended = True
            return False
        except PermissionError:
            return False
        return True


def descendants(pid: int) -> list[int]:
    """The processes below `pid` now, through their parents (/proc; a process re-parented to init is not found)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def _group_of(pid: int) -> int | None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        return os.getpgid(pid)
    return None
