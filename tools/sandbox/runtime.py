"""The sandbox runtime interface (`start / run / read / write / reset / close`), its results, and the local
runtime.

`DockerRuntime` (docker_runtime.py) is the real sandbox. `LocalRuntime` runs commands as plain subprocesses
of this process, in a temporary workspace, with resource limits (rlimits: CPU time, address space, file
size) and a wall-clock timeout that kills the whole process group; a watchdog kills the group too if this
process dies during a run (a SIGKILL, the OOM killer). It is NOT isolated: the code can read
and write anything this user can, reach the network, and escape its process group with `setsid`. It exists
for unit tests and for users without Docker, on code they trust.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from agentrl.system.lifetime import Watchdog
from agentrl.tools.errors import ToolError
from agentrl.tools.sandbox import runner


class SandboxError(ToolError):
    """The sandbox failed (not the code in it): it could not start, or died. The episode ends as `error`."""


@dataclass(frozen=True)
class Limits:
    timeout: float = 10.0  # wall-clock seconds per run; the run and everything it started are killed after
    memory_mb: int = 512  # the container's memory (no swap); the local runtime's address space
    cpus: float = 1.0
    pids: int = 64  # processes and threads in the container (a fork bomb stops here)
    disk_mb: int = 64  # the writable workspace; the root filesystem is read-only
    output_bytes: int = 16_000  # stdout + stderr kept per run: head and tail, the cut stated

    def __post_init__(self) -> None:
        if min(self.timeout, self.memory_mb, self.cpus, self.pids, self.disk_mb, self.output_bytes) <= 0:
            raise ValueError(f"sandbox limits must all be > 0, got {self}")


@dataclass(frozen=True)
class RunResult:
    exit_code: int | None  # None when the run was killed at the timeout
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False  # output went over the budget: head and tail are kept, the cut is marked
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether the run exited with code 0 (never when it timed out)."""
        return self.exit_code == 0

    def observation(self) -> str:
        """What the model reads: the output, then how the run ended."""
        parts = [self.stdout.rstrip("\n")] if self.stdout.strip() else []
        if self.stderr.strip():
            parts.append(self.stderr.rstrip("\n"))
        if self.timed_out:
            parts.append(f"[killed: still running after the {self.seconds:.0f} s timeout]")
        elif self.exit_code != 0:
            parts.append(f"[exit code {self.exit_code}]")
        return "\n".join(parts) if parts else "[no output]"


class Runtime(Protocol):
    """What a sandbox offers, `LocalRuntime` and `DockerRuntime` alike; `SandboxPool` holds them."""

    limits: Limits

    def start(self) -> None:
        """Gets the sandbox ready (its workspace, its container); does nothing if already started."""

    def run(self, argv: Sequence[str] | None = None, *, code: str | None = None, stdin: str = "",
            timeout: float | None = None) -> RunResult:
        """Runs argv, or Python `code`, in the workspace. The code's failures are in the result; the
        sandbox's own raise SandboxError."""

    def read(self, path: str) -> str:
        """A file of the workspace (paths are relative to it and may not leave it); OSError if it cannot."""

    def write(self, path: str, content: str | bytes) -> None:
        """Creates or replaces a workspace file (text as UTF-8), making its directories; OSError if it cannot."""

    def reset(self) -> None:
        """Kills every process and empties the workspace: ready for the next episode."""

    def healthy(self) -> bool:
        """Whether the sandbox still works; the pool replaces one that does not."""

    def close(self) -> None:
        """Idempotent."""


class LocalRuntime:
    """Subprocesses in a temporary directory, with rlimits. Not isolated: see the module docstring."""

    def __init__(self, limits: Limits = Limits()):
        self.limits, self.workspace, self._watchdog = limits, None, None

    def start(self) -> None:
        """Creates the temporary workspace and the runs' watchdog unless they exist."""
        if self.workspace is None:
            self.workspace = Path(tempfile.mkdtemp(prefix="agentrl-local-sandbox-"))
        if self._watchdog is None or not self._watchdog.alive():
            self._watchdog = Watchdog(grace=0)  # a run has nothing to save: SIGKILL at once

    def run(self, argv: Sequence[str] | None = None, *, code: str | None = None, stdin: str = "",
            timeout: float | None = None) -> RunResult:
        """Runs argv, or Python `code`, as a subprocess in the workspace (see `Runtime.run`); kills its group after."""
        self.start()
        if (argv is None) == (code is None):
            raise ValueError("run needs argv or code, not both")
        if code is not None:
            (self.workspace / ".agentrl_main.py").write_text(code)
            argv = [sys.executable, "-u", ".agentrl_main.py"]
        limits, watchdog = self.limits, self._watchdog

        def setup() -> None:  # in the child, before exec, in the new session whose id is the child's pid
            watchdog.watch(os.getpid())
            runner._child_setup()
            cpu = int(timeout or limits.timeout) + 1
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
            resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb << 20,) * 2)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limits.disk_mb << 20,) * 2)

        def kill_group(proc: subprocess.Popen) -> None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        reply = runner.run(list(argv), stdin, timeout or limits.timeout, limits.output_bytes, kill_group,
                           cwd=str(self.workspace), setup=setup)
        return run_result(reply)

    def read(self, path: str) -> str:
        """A workspace file; PermissionError (an OSError) for a path outside the workspace."""
        return self._inside(path).read_text()

    def write(self, path: str, content: str | bytes) -> None:
        """Creates or replaces a workspace file, making its directories; PermissionError outside the workspace."""
        target = self._inside(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content.encode() if isinstance(content, str) else content)

    def _inside(self, path: str) -> Path:
        self.start()
        full = (self.workspace / path).resolve()
        if not full.is_relative_to(self.workspace.resolve()):
            raise PermissionError(f"{path!r} is outside the workspace")
        return full

    def reset(self) -> None:
        """Replaces the workspace with a fresh, empty one (each run's process group is killed when it ends)."""
        self._remove_workspace()
        self.start()

    def healthy(self) -> bool:
        """Always True: there is no container or runner that could die."""
        return True

    def close(self) -> None:
        """Deletes the workspace and lets the watchdog go; idempotent (`start`, `run`, `read` and `write` start
        again)."""
        self._remove_workspace()
        if self._watchdog is not None:
            self._watchdog.close()  # it exits once the last run's group is gone (at once: runs end before returning)
            self._watchdog = None

    def _remove_workspace(self) -> None:
        if self.workspace is not None:
            shutil.rmtree(self.workspace, ignore_errors=True)
            self.workspace = None


def run_result(reply: dict) -> RunResult:
    """A reply of the sandbox runner (`runner.run`'s dict, in this process or in the container) as a `RunResult`."""
    return RunResult(reply["exit_code"], reply["stdout"], reply["stderr"], reply["timed_out"], reply["truncated"],
                     reply["seconds"])
