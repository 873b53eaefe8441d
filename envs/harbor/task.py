"""Harbor task folders (https://harborframework.com, the format Terminal-Bench ships in) read as agentrl tasks:

    TASK/instruction.md              the agent's task: the episode's first user message
    TASK/task.toml                   [task] name; [agent] timeout_sec, user; [verifier] timeout_sec, env, user,
                                     environment_mode ("shared" | "separate"); [environment] workdir, cpus,
                                     memory_mb, env; artifacts (what a separate verifier gets from the agent's box)
    TASK/environment/Dockerfile      the agent's box (its context: environment/)
    TASK/tests/test.sh               run after the episode; writes /logs/verifier/reward.txt (a number) or
                                     reward.json ({"reward": ..., other keys})
    TASK/tests/Dockerfile            (optional) a separate verifier's own image
    TASK/solution/solve.sh           the gold solution (`agentrl envs check`)

`tasks = DIR` is one task folder or a folder of them (every folder below it with a task.toml). Multi-step tasks
(`[[steps]]`), Docker Compose environments and Windows tasks are refused with a message, not half-run.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from agentrl.types import Task


class HarborTaskError(ValueError):
    """A task folder this adapter cannot run; the message names the folder and why."""


@dataclass(frozen=True)
class HarborTask:
    """One task folder, read."""

    folder: Path
    name: str
    instruction: str
    config: dict
    workdir: str  # "" when neither task.toml nor the Dockerfile names one (the image's own)

    @property
    def separate_verifier(self) -> bool:
        """Whether the tests run in an environment of their own, with the artifacts (Harbor's resolution: an
        explicit `environment_mode`, else separate when the verifier names an environment or image)."""
        verifier = self.config.get("verifier", {})
        mode = verifier.get("environment_mode")
        return mode == "separate" if mode else bool(verifier.get("environment"))

    @property
    def artifacts(self) -> list[str]:
        """The paths a separate verifier gets from the agent's final box."""
        return [a if isinstance(a, str) else a["source"] for a in self.config.get("artifacts", [])]

    def timeout(self, phase: str, default: float) -> float:
        """`[agent]` or `[verifier]` `timeout_sec`."""
        return float(self.config.get(phase, {}).get("timeout_sec") or default)

    def as_task(self, split: str) -> Task:
        """The agentrl task: its id is the task's name, its data where to find the rest."""
        return Task(self.name, {"folder": str(self.folder), "instruction": self.instruction}, split)


def read_task(folder: Path) -> HarborTask:
    """The task in `folder`; HarborTaskError for what is missing or not supported."""
    missing = [f for f in ("instruction.md", "task.toml", "environment/Dockerfile", "tests/test.sh")
               if not (folder / f).is_file()]
    if missing:
        raise HarborTaskError(f"{folder}: not a Harbor task this adapter runs: no {', '.join(missing)}")
    try:
        config = tomllib.loads((folder / "task.toml").read_text())
    except tomllib.TOMLDecodeError as e:
        raise HarborTaskError(f"{folder / 'task.toml'}: {e}") from e
    environment = config.get("environment", {})
    if config.get("steps"):
        raise HarborTaskError(f"{folder}: multi-step tasks ([[steps]]) are not supported")
    if environment.get("os", "linux") != "linux":
        raise HarborTaskError(f"{folder}: only linux tasks run here (os = {environment['os']!r})")
    if (folder / "environment" / "docker-compose.yaml").exists():
        raise HarborTaskError(f"{folder}: Docker Compose environments are not supported")
    return HarborTask(folder, config.get("task", {}).get("name") or folder.name,
                      (folder / "instruction.md").read_text().strip(), config,
                      environment.get("workdir") or dockerfile_workdir(folder / "environment" / "Dockerfile"))


def find_tasks(root: Path) -> list[HarborTask]:
    """`root` if it is a task, else every task folder below it, by name; HarborTaskError if there is none."""
    folders = [root] if (root / "task.toml").is_file() else sorted(p.parent for p in root.rglob("task.toml"))
    if not folders:
        raise HarborTaskError(f"no Harbor task (a folder with task.toml) at {root}")
    return sorted((read_task(f) for f in folders), key=lambda t: t.name)


def dockerfile_workdir(dockerfile: Path) -> str:
    """The last `WORKDIR` of the Dockerfile's last stage (relative ones joined), or ""."""
    workdir = ""
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if words and words[0].upper() == "FROM":
            workdir = ""
        elif len(words) > 1 and words[0].upper() == "WORKDIR":
            workdir = str(PurePosixPath(workdir or "/") / words[1])
    return workdir
