"""`harbor/tasks-v0`: Harbor tasks (`tasks = DIR`, see task.py) as a tool env.

The episode opens with the task's instruction; the agent acts in a box of the task's image (box.py) through
`bash(command)` (a fresh shell in the working directory each time), `view`, `edit` and `create` (paths relative to
the working directory, or absolute), and ends with `submit(summary)`, or when its turns run out. Then the tests
grade, as Harbor's verifier does, the box's final state, never the live box:

- shared mode (the default): an image is committed from the agent's box, which is then removed (with every
  process the agent left), and the tests run in a fresh container of that image;
- separate mode (`[verifier] environment_mode = "separate"`): the tests run in a fresh container of
  `tests/Dockerfile`'s image, else of the task's own image, into which the task's `artifacts` are copied from
  the agent's final box.

`tests/` goes to `/tests` and `bash /tests/test.sh` runs from the working directory, as `[verifier] user`, with
`[verifier] env`, under `[verifier] timeout_sec`. The reward is `/logs/verifier/reward.json`'s `reward` (its other
numbers become reward components) or else `reward.txt`'s number; a test run that writes neither scores 0, with
the test output in the detail. `solution/` goes to `/solution` and `bash /solution/solve.sh` is the gold action.
"""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path
from typing import Sequence

from agentrl.env.api import Score, ToolEnv
from agentrl.envs.docker_ready import require_docker
from agentrl.envs.harbor.box import Box, build, remove_image
from agentrl.envs.harbor.task import HarborTask, find_tasks
from agentrl.tools import PARSERS, ParsedAction, ToolSet, tool
from agentrl.tools.editing import editing_tools
from agentrl.tools.sandbox import SandboxError
from agentrl.tools.sandbox.docker_runtime import BASE_IMAGE
from agentrl.types import Message, Task, ToolCall

SYSTEM_PROMPT = ("You solve a task in a Linux machine. Use bash to run commands (each in a fresh shell in the "
                 "working directory{where}), view to read files, edit and create to change them. When the task "
                 "is done, call submit with a one-line summary: the machine is then checked.\n{fmt}")
VERIFIER_DIRS = "/logs/verifier /logs/agent /logs/artifacts"


class HarborEnv(ToolEnv):
    """Harbor task folders (`tasks = DIR`) in Docker boxes, graded by their own tests.

    `timeout`: seconds per command; `memory_mb`, `cpus`: the box's (a task's `[environment]` values win);
    `network`: whether boxes reach the network; `base_image`: what replaces a `FROM` image that cannot be pulled.
    Every split holds every task of `tasks`: point held-out evaluation at another folder.
    """

    def __init__(self, tasks: str, split: str = "train", parser: str = "hermes", max_turns: int = 20,
                 max_invalid: int = 3, timeout: float = 60.0, memory_mb: int = 2048, cpus: float = 1.0,
                 network: bool = False, base_image: str = BASE_IMAGE):
        if parser != "hermes":
            raise ValueError(f"Harbor tasks read Hermes tool calls (commands span lines); got parser {parser!r}")
        self.root = Path(tasks).expanduser()
        self.timeout, self.memory_mb, self.cpus, self.network = timeout, memory_mb, cpus, network
        self.base_image = base_image
        self.harbor: dict[str, HarborTask] = {}
        self.box: Box | None = None

        @tool(timeout=timeout + 30.0)
        def bash(command: str) -> str:
            """Run a shell command in the working directory (a fresh shell each time) and return its output.

            Args:
                command: The command, e.g. "ls -la" or "python3 script.py".
            """
            return self._box().run(command, self.timeout, user=self._agent_user()).observation()

        @tool(timeout=1.0)
        def submit(summary: str) -> str:
            """Finish: the machine as it is now is checked by the task's tests.

            Args:
                summary: One line on what you did.
            """
            return summary

        files = editing_tools(lambda path: self._box().read(path), lambda path, text: self._box().write(path, text),
                              "the working directory (or absolute)")
        super().__init__(ToolSet([bash, *files, submit]), PARSERS[parser](), split=split, max_turns=max_turns,
                         max_invalid=max_invalid, reward_weights={"reward": 1.0}, answer_tool="submit")

    # --- tasks ----------------------------------------------------------------------------------------------

    def load_tasks(self, split: str) -> Sequence[Task]:
        """Every task folder of `tasks`."""
        self.harbor = {t.name: t for t in find_tasks(self.root)}
        return [t.as_task(split) for t in self.harbor.values()]

    def first_messages(self, task: Task) -> Sequence[Message]:
        """The system prompt and the task's instruction."""
        workdir = self._harbor(task).workdir
        return (Message("system", SYSTEM_PROMPT.format(where=f", {workdir}" if workdir else "",
                                                       fmt=self.parser.instructions)),
                Message("user", task.data["instruction"]))

    def _harbor(self, task: Task) -> HarborTask:
        if not self.harbor:
            self.tasks  # noqa: B018 -- loads them
        return self.harbor[task.id]

    # --- the box of an episode ------------------------------------------------------------------------------

    def check_ready(self) -> None:
        """The Docker daemon answers."""
        require_docker("Harbor tasks run in Docker boxes")

    def on_reset(self, task: Task) -> None:
        super().on_reset(task)
        self._close_box()
        self.box = self._new_box(self._harbor(task), self._image(task)).start()

    def _image(self, task: Task) -> str:
        folder = self._harbor(task).folder / "environment"
        return build(folder, folder / "Dockerfile", self.base_image)

    def _new_box(self, t: HarborTask, image: str) -> Box:
        environment = t.config.get("environment", {})
        return Box(image, t.workdir, env=environment.get("env"), network=self.network,
                   memory_mb=int(environment.get("memory_mb") or self.memory_mb),
                   cpus=float(environment.get("cpus") or self.cpus))

    def _box(self) -> Box:
        if self.box is None:
            raise SandboxError("no box: reset() the env first")
        return self.box

    def _agent_user(self) -> str | None:
        user = self._harbor(self.task).config.get("agent", {}).get("user")
        return None if user is None else str(user)

    def _close_box(self) -> None:
        if self.box is not None:
            box, self.box = self.box, None
            box.close()

    def close(self) -> None:
        self._close_box()
        super().close()

    # --- grading --------------------------------------------------------------------------------------------

    def act(self, action: str):
        obs, reward, done, info = super().act(action)
        if not done and self.turn >= self.max_turns:  # Harbor grades whatever the box holds when the agent stops
            _, reward, done, final = self._finish("")
            info = {**info, **final, "reason": f"graded at max_turns={self.max_turns}"}
        return obs, reward, done, info

    def score(self, task: Task, answer: str, transcript: Sequence[ParsedAction]) -> Score:
        t, final_image = self._harbor(task), ""
        try:
            if t.separate_verifier:
                tests = t.folder / "tests"
                image = build(tests, tests / "Dockerfile", self.base_image) if (tests / "Dockerfile").exists() \
                    else self._image(task)
                verifier = self._new_box(t, image).start()
                missing = [path for path in t.artifacts if not self._box().copy_to(verifier, path)]
            else:
                final_image = self._box().commit()
                verifier, missing = self._new_box(t, final_image).start(), []
            self._close_box()  # nothing the agent left running takes part
            try:
                return self._verify(t, verifier, missing)
            finally:
                verifier.close()
        finally:
            if final_image:
                remove_image(final_image)

    def _verify(self, t: HarborTask, verifier: Box, missing: list[str]) -> Score:
        verifier.run(f"mkdir -p {VERIFIER_DIRS} && rm -f /logs/verifier/reward.txt /logs/verifier/reward.json",
                     timeout=30, user="root")
        if not (t.separate_verifier and (t.folder / "tests" / "Dockerfile").exists()):  # else its image holds them
            upload(verifier, t.folder / "tests", "/tests")
        verifier_config = t.config.get("verifier", {})
        user = verifier_config.get("user")
        result = verifier.run("bash /tests/test.sh", t.timeout("verifier", 600.0),
                              user=None if user is None else str(user), env=verifier_config.get("env") or None)
        detail = f"test.sh: {result.observation()[-1500:]}"
        if missing:
            detail += f"\nartifacts not found in the agent's box: {', '.join(missing)}"
        rewards = read_rewards(verifier)
        if rewards is None:
            return Score({"reward": 0.0}, "no reward: test.sh wrote no /logs/verifier/reward.txt or reward.json\n"
                                          + detail)
        return Score(rewards, detail)

    # --- the gold solution ----------------------------------------------------------------------------------

    def gold_actions(self, task: Task) -> list[str]:
        """One `bash` call that writes `solution/` to `/solution` and runs `solve.sh` there; then submit."""
        folder = self._harbor(task).folder / "solution"
        if not (folder / "solve.sh").is_file():
            raise NotImplementedError(f"{task.id} has no solution/solve.sh")
        writes = [f"mkdir -p {shlex.quote(str(Path('/solution', p.relative_to(folder).parent)))} && "
                  f"cat > {shlex.quote(str(Path('/solution', p.relative_to(folder))))} <<'AGENTRL_EOF'\n"
                  f"{p.read_text().rstrip()}\nAGENTRL_EOF"
                  for p in sorted(folder.rglob("*")) if p.is_file()]
        command = "\n".join([*writes, "bash /solution/solve.sh"])
        return [self.parser.format_call(ToolCall("bash", {"command": command})),
                self.parser.format_call(ToolCall("submit", {"summary": "solved"}))]


def upload(box: Box, folder: Path, target: str) -> None:
    """A host folder's files into `target` in the box (modes kept: test.sh stays executable)."""
    files = {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mode & 0o777)
             for p in sorted(folder.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}
    box.run(f"mkdir -p {shlex.quote(target)}", timeout=30, user="root")
    box.put(target, files)


def read_rewards(box: Box) -> dict[str, float] | None:
    """The verifier's rewards: reward.json's numbers (its `reward` key, else their mean, as `reward`), else
    reward.txt's number; None if there is neither or it is not a finite number."""
    try:
        values = json.loads(box.read("/logs/verifier/reward.json"))
        values = values if isinstance(values, dict) else {"reward": values}
        rewards = {k: float(v) for k, v in values.items() if isinstance(v, (int, float))}
        rewards.setdefault("reward", sum(rewards.values()) / len(rewards) if rewards else math.nan)
    except (OSError, ValueError):
        try:
            rewards = {"reward": float(box.read("/logs/verifier/reward.txt").strip())}
        except (OSError, ValueError):
            return None
    return rewards if all(math.isfinite(v) for v in rewards.values()) else None
