"""Coding-agent CLIs as they are (Codex CLI, Claude Code), fixing a `swe/generated-v0` bug through the gateway: the
part they share. `swe_codex.py` and `swe_claude.py` say how each CLI is started.

Where a CLI runs: on the host, in a temporary checkout of the task's repository (the SWE env's own set-up, on a
`LocalRuntime`). Not in the SWE env's Docker sandbox: that has no network, so the CLI there could not reach the
gateway. When the CLI ends (it answered, or it stopped on a failed call), the checkout's files replace the repository
in the SWE env's sandbox, which grades it as `swe/generated-v0` does (hidden tests, SWE-bench's rule). A CLI past
its timeout, killed by a signal, or ending without any model reply, is an `error` episode; its process group (what
it started included) is killed either way, and as soon as the gateway has ended its session (past `max_turns`, or
flooding it with refused calls).
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable

import httpx
from agentrl.envs.swe import SWEEnv
from agentrl.envs.swe.env import REPO, setup
from agentrl.system.lifetime import ProcessGroup
from agentrl.tools.sandbox import Limits, LocalRuntime, SandboxError
from agentrl.types import Task

NPM_BIN = Path("~/.cache/agentrl/npm/node_modules/.bin").expanduser()  # `make setup-codex` / `make setup-claude`


def run_cli(command: list[str], env: dict[str, str], timeout: float, log: Path, cwd: Path,
            session: str | None = None) -> int | None:
    """`command`'s exit code (None: killed at `timeout`, or once the gateway ended `session`, a base_url), run in
    `cwd`; its output goes to `log`, its processes end with it."""
    if not Path(command[0]).exists():
        raise FileNotFoundError(f"no {Path(command[0]).name} at {command[0]}: see this module's `make` target")
    deadline = time.monotonic() + timeout
    with open(log, "wb") as out:
        group = ProcessGroup(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env={**os.environ, **env}, cwd=cwd)
        try:
            while True:
                try:
                    return group.process.wait(max(0.01, min(0.5, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    if time.monotonic() >= deadline or (session is not None and ended(session)):
                        return None
        finally:  # at once: a CLI told to stop (SIGTERM) can start a command on its way out
            group.kill()


def ended(base_url: str) -> bool:
    """Whether the gateway has ended the session that `base_url` (`.../sessions/ID/v1`) serves, or is gone."""
    try:
        return httpx.get(base_url.removesuffix("/v1"), timeout=5.0).json().get("closed", True)
    except httpx.TransportError:
        return True


def replace_repository(env: SWEEnv, checkout: Path) -> None:
    """The checkout's files (not its .git) in place of the repository's in the env's sandbox."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in sorted(checkout.rglob("*")):
            if path.is_file() and ".git" not in path.relative_to(checkout).parts:
                tar.add(path, arcname=str(path.relative_to(checkout)))
    env.sandbox.write(".final.tar", buffer.getvalue())
    result = env.sandbox.run(argv=["bash", "-c", f"cd {REPO} && find . -mindepth 1 -maxdepth 1 ! -name .git "
                                                 f"-exec rm -rf {{}} + && tar -xf ../.final.tar && rm ../.final.tar"])
    if not result.ok:
        raise SandboxError(f"could not put the agent's repository into the sandbox: {result.observation()[-300:]}")


def solve_with(task: Task, base_url: str, name: str,
               command: Callable[[Path, Path], tuple[list[str], dict[str, str]]], timeout: float,
               answered: Callable[[int, str], bool]) -> float:
    """One episode on `task` of the CLI that `command(checkout, home)` gives (its argv and environment variables,
    `home` a fresh folder for its settings), its model behind `base_url`; the graded outcome. `answered(code,
    output)` says whether the CLI got a model reply (else: `error`)."""
    host = LocalRuntime(Limits(timeout=120.0, memory_mb=4096, disk_mb=1024))
    swe = SWEEnv(split=task.split)
    try:
        setup(host, task)
        with tempfile.TemporaryDirectory(prefix="agentrl-cli-") as home:
            log = Path(home) / "cli.log"
            checkout = host.workspace / REPO
            code = run_cli(*command(checkout, Path(home)), timeout, log, checkout, session=base_url)
            tail = log.read_text(errors="replace")[-2000:]
        if code is None and ended(base_url):
            raise RuntimeError(f"{name} was stopped: the gateway ended its session (its reason is the episode's)")
        if code is None:
            raise TimeoutError(f"{name} ran past {timeout:.0f} s and was killed: {tail[-500:]}")
        if code < 0 or not answered(code, tail):  # killed by a signal: a crash, whatever its children printed
            raise RuntimeError(f"{name} failed (exit code {code}) before its run ended: {tail[-500:]}")
        swe.reset(options={"task": task})
        replace_repository(swe, host.workspace / REPO)
        return swe.score(task, "", []).components["outcome"]
    finally:
        swe.close()
        host.close()
