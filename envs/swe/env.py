"""`swe/generated-v0` and `swe/instances-v0`: fix a bug in a real repository inside a Docker sandbox.

Tools, as mini-swe-agent and SWE-agent give them: `bash(command)` (stateless: each command runs in a fresh
shell in the repository, with a timeout and head/tail output truncation), `view(path, start, end)`,
`edit(path, old, new)` (replace one exact, unique occurrence), `create(path, content)`, and `submit(summary)`.
At submit, or when the turns run out, the repository is graded as SWE-bench grades it, in a sandbox the agent
never touched: the agent's diff against the base commit recorded at setup (not `HEAD`, which the agent can
move) is applied to a fresh copy, without the files of `test_patch`, without what configures the test run
(`conftest.py`, pytest and packaging settings, `*customize.py`, `.pth`) and without new files outside the
repository's packages (`gradable`: an allow-list, since a config, plugin entry point or shadowing module can take
any name); the files the patch changed are checked against those it names; the test patch is applied (so deleting,
editing or committing tests changes nothing); the tests run with no user site, a fresh `HOME` and without the
working directory first on `sys.path`; and the
reward is 1 iff every FAIL_TO_PASS and every PASS_TO_PASS test passes; the fraction of each is reported. Test
output that contradicts itself (a test with two statuses, status lines that disagree with the final counts, a
second summary) is a failure, as is a run that never reached its summary. The hidden tests are never in the
agent's sandbox.

Each episode leases a sandbox of its instance's image from the pool and puts the repository into the
workspace: generated instances upload the host's snapshot (their images hold no clean copy, which would show
the bug and the hidden tests), SWE-bench style instances copy `repo_dir` from their image. Generated
instances then get their bug (`setup_patch`), lose their test files (`hidden_tests`), and start a fresh git
history, so `git log` holds no answer.
"""

from __future__ import annotations

import random
import shlex
from pathlib import Path, PurePosixPath
from typing import Sequence

from agentrl.env.api import Score, ToolEnv
from agentrl.envs.docker_ready import require_docker
from agentrl.envs.swe.generate import CACHE, INSTANCES
from agentrl.envs.swe.repos import REPOS, fetch, upload
from agentrl.envs.swe.instances import InconsistentOutput, load, parse_pytest_summary
from agentrl.tools import PARSERS, ParsedAction, ToolSet, tool
from agentrl.tools.editing import editing_tools
from agentrl.tools.sandbox import Limits, Runtime, SandboxError
from agentrl.tools.sandbox.pool import shared_pool
from agentrl.types import Message, Task, ToolCall

REPO = "repo"  # the repository's place in the workspace
GIT = "git -c user.name=agentrl -c user.email=agentrl@localhost"
# Reading the agent's repository: no replaced objects, hooks, external diff programs or text conversions of its own,
# and the diff's a/ and b/ prefixes whatever its git config says (another prefix would hide a path from the filter).
READ_GIT = ("GIT_NO_REPLACE_OBJECTS=1 git -c core.hooksPath=/dev/null -c diff.noprefix=false "
            "-c diff.mnemonicPrefix=false")
# Files that configure the test run rather than the code under test: an agent's change to them is not graded.
TEST_CONFIG = {"conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "sitecustomize.py",
               "usercustomize.py"}
# The tests run with no user site, a fresh HOME, none of the agent's Python settings, and without the working
# directory first on sys.path (PYTHONSAFEPATH: a module there would shadow the standard library or pytest itself).
TEST_ENV = "env -u PYTHONPATH -u PYTHONSTARTUP HOME=/tmp/agentrl-home PYTHONNOUSERSITE=1 PYTHONSAFEPATH=1"
SYSTEM_PROMPT = (
    "You fix bugs in a Python repository, which is your working directory. Use bash to explore and run "
    "code, view to read files, edit and create to change them; every bash command runs in a fresh shell. "
    "When the bug is fixed, call submit with a one-line summary.\n{fmt}"
)


def spec_of(name: str):
    """The pinned repository `name` of the generated instances."""
    return next(spec for spec in REPOS if spec.name == name)


class SWEEnv(ToolEnv):
    """Fix a bug in a repository inside a Docker sandbox (`swe/generated-v0`, `swe/instances-v0`), graded as
    SWE-bench grades it.

    `instances` is a SWE-bench style JSONL or a folder of tasks (default: the generated instances). Only the
    `hermes` parser is accepted (arguments span lines); another raises ValueError.
    """

    def __init__(self, split: str = "train", instances: str | None = None, n_tasks: int | None = None,
                 parser: str = "hermes", max_turns: int = 20, max_invalid: int = 3, timeout: float = 30.0,
                 memory_mb: int = 1024, pool_size: int = 4):
        if parser != "hermes":
            raise ValueError(f"the SWE env reads Hermes tool calls (arguments span lines); got parser {parser!r}")
        self.instances = Path(instances).expanduser() if instances else INSTANCES
        self.n_tasks, self.pool_size = n_tasks, pool_size
        self.max_concurrent_episodes = pool_size  # each holds a sandbox from reset to close (pools are per image)
        self.limits = Limits(timeout=timeout, memory_mb=memory_mb, disk_mb=256, pids=128)
        self._sandbox: Runtime | None = None
        self._sandbox_image: str | None = None
        self._base = ""  # the commit the episode started from, recorded at setup

        @tool(timeout=timeout + 30.0)
        def bash(command: str) -> str:
            """Run a shell command in the repository (a fresh shell each time) and return its output.

            Args:
                command: The command, e.g. "grep -n ordinal -r ." or "python3 -c 'import pkg; print(pkg.f(1))'".
            """
            return self.sandbox.run(argv=["bash", "-c", f"cd {REPO} && {command}"]).observation()

        @tool(timeout=1.0)
        def submit(summary: str) -> str:
            """Finish: the repository as it is now is graded by hidden tests.

            Args:
                summary: One line on what you changed.
            """
            return summary

        files = editing_tools(lambda path: self.sandbox.read(f"{REPO}/{path}"),
                              lambda path, text: self.sandbox.write(f"{REPO}/{path}", text), "the repository")
        super().__init__(ToolSet([bash, *files, submit]), PARSERS[parser](), split=split,
                         max_turns=max_turns, max_invalid=max_invalid, reward_weights={"outcome": 1.0},
                         answer_tool="submit")

    # --- tasks ----------------------------------------------------------------------------------------------

    def load_tasks(self, split: str) -> Sequence[Task]:
        """The first `n_tasks` instances of `split`; FileNotFoundError if `instances` does not exist (generate them
        with `agentrl swe generate`)."""
        if not self.instances.exists():
            raise FileNotFoundError(f"no SWE instances at {self.instances}: generate them with `agentrl swe generate` "
                                    "(or pass instances=PATH: a SWE-bench style JSONL, or a folder of tasks)")
        return load(self.instances, split)[:self.n_tasks]

    def first_messages(self, task: Task) -> Sequence[Message]:
        """The system prompt and the instance's problem statement."""
        return (Message("system", SYSTEM_PROMPT.format(fmt=self.parser.instructions)),
                Message("user", task.data["problem_statement"]))

    # --- the sandbox of an episode --------------------------------------------------------------------------

    def check_ready(self) -> None:
        """The Docker daemon answers."""
        require_docker("the SWE env's repositories live in Docker sandboxes")

    @property
    def sandbox(self) -> Runtime:
        """This episode's sandbox, leased at `reset()`; SandboxError when none is held."""
        if self._sandbox is None:
            raise SandboxError("no sandbox: reset() the env first")
        return self._sandbox

    def on_reset(self, task: Task) -> None:
        super().on_reset(task)
        self._release()
        self._sandbox_image = task.data["image"]
        self._sandbox = self._pool().acquire()
        self._base = setup(self.sandbox, task)

    def _pool(self):
        return shared_pool("docker", self.limits, self.pool_size, image=self._sandbox_image)

    def _release(self) -> None:
        if self._sandbox is not None:
            sandbox, self._sandbox = self._sandbox, None
            self._pool().release(sandbox)

    def close(self) -> None:
        self._release()
        super().close()

    # --- grading --------------------------------------------------------------------------------------------

    def act(self, action: str):
        obs, reward, done, info = super().act(action)
        if not done and self.turn >= self.max_turns:  # SWE-bench grades whatever the repository holds at the end
            _, reward, done, final = self._finish("")
            info = {**info, **final, "reason": f"graded at max_turns={self.max_turns}"}
        return obs, reward, done, info

    def score(self, task: Task, answer: str, transcript: Sequence[ParsedAction]) -> Score:
        d = task.data
        diff = self._agent_diff()
        self._release()  # graded elsewhere: nothing the agent left in its sandbox (files, processes) takes part
        with self._pool().lease() as grader:
            setup(grader, task)
            base = set(grader.run(argv=["bash", "-c", f"cd {REPO} && git ls-files -z"]).stdout.split("\0"))
            test_files = patch_paths(d["test_patch"])
            graded, left_out = split_patch(diff, lambda path: not gradable(path, base, test_files))
            problem = self._apply(grader, graded)
            if not problem:
                steps = [f"cd {REPO}"]
                if d["test_patch"]:
                    grader.write(".test.patch", d["test_patch"])
                    steps.append("git apply --binary ../.test.patch")
                # to a file: the summary of every test is longer than a tool call's output budget
                steps.append(f"mkdir -p /tmp/agentrl-home && (COLUMNS=250 {TEST_ENV} {d['test_cmd']}) > "
                             "../.test_output 2>&1; true")
                result = grader.run(argv=["bash", "-c", " && ".join(steps)], timeout=max(self.limits.timeout, 300))
            outcomes = {}
            try:
                outcomes = {} if problem else parse_pytest_summary(grader.read(".test_output"))
            except InconsistentOutput as e:
                problem = f"the test output is not to be trusted: {e}"
            except OSError:
                pass
        f2p, p2p = (sum(outcomes.get(t) == "PASSED" for t in tests) / len(tests) if tests else 1.0
                    for tests in (d["FAIL_TO_PASS"], d["PASS_TO_PASS"]))
        resolved = float(f2p == 1.0 and p2p == 1.0 and not problem)
        detail = f"FAIL_TO_PASS {f2p:.2f}, PASS_TO_PASS {p2p:.2f}"
        if problem or not outcomes:
            detail += f"; {problem or 'the tests did not run: ' + result.observation()[-300:]}"
        if left_out:
            detail += f"; not graded (tests, test settings, or new files outside the packages): {', '.join(left_out)}"
        return Score({"outcome": resolved, "fail_to_pass": f2p, "pass_to_pass": p2p}, detail + f"\n--- diff\n{diff}")

    @staticmethod
    def _apply(grader: Runtime, patch: str) -> str:
        """Applies the graded part of the agent's patch to the grader's repository; the problem, if any. A path
        changed that the patch's parsed names do not hold (a prefix or quoting the filter did not read) is a
        problem: nothing is graded."""
        if not patch:
            return ""
        grader.write(".agent.patch", patch)
        result = grader.run(argv=["bash", "-c", f"cd {REPO} && git apply --binary ../.agent.patch && "
                                                "git add -A --force && git diff --cached --name-only -z --no-renames"])
        if not result.ok:
            return f"the agent's patch does not apply: {result.observation()[-300:]}"
        changed = {p for p in result.stdout.split("\0") if p}
        if unnamed := sorted(changed - patch_paths(patch)):
            return f"the patch changed {', '.join(unnamed)}, which its file headers do not name"
        return ""

    def _agent_diff(self) -> str:
        """Everything the agent changed since the base commit, new files included, as a binary-safe patch."""
        write = (f"cd {REPO} && {READ_GIT} add -A && {READ_GIT} diff --cached --binary --no-ext-diff --no-textconv "
                 f"--src-prefix=a/ --dst-prefix=b/ {self._base} > ../.agent.patch")
        result = self.sandbox.run(argv=["bash", "-c", write])
        return self.sandbox.read(".agent.patch") if result.ok else ""

    # --- the gold solution ----------------------------------------------------------------------------------

    def gold_actions(self, task: Task) -> list[str]:
        """The gold patch as one `edit` when it is one hunk of one file (short enough for small models),
        else applied with `git apply`; then submit."""
        edit = single_hunk_edit(task.data["patch"])
        if edit is not None:
            fix = ToolCall("edit", edit)
        else:
            fix = ToolCall("bash", {"command": f"cat > /tmp/fix.patch <<'AGENTRL_PATCH'\n{task.data['patch']}"
                                               "AGENTRL_PATCH\ngit apply /tmp/fix.patch"})
        return [self.parser.format_call(fix), self.parser.format_call(ToolCall("submit", {"summary": "fixed"}))]

    def demonstration(self, task: Task, rng: random.Random, error_rate: float = 0.0) -> list[str]:
        """The gold fix; with probability `error_rate`, submitting without changing anything."""
        if rng.random() < error_rate:
            return [self.parser.format_call(ToolCall("submit", {"summary": "no change needed"}))]
        return self.gold_actions(task)


def setup(sandbox: Runtime, task: Task) -> str:
    """Puts the task's repository, as an episode starts, into `sandbox`'s workspace; returns its base commit."""
    d = task.data
    if d["repo_dir"]:  # an instance whose image holds its repository (SWE-bench style)
        steps = [f"cp -a {shlex.quote(d['repo_dir'])}/. {REPO}", f"cd {REPO}"]
    else:  # a generated one: the host's snapshot (its image holds no copy the agent could diff against)
        upload(sandbox, fetch(spec_of(d["repo"]), CACHE), REPO)
        steps = [f"cd {REPO}"]
    if d.get("setup_patch"):
        sandbox.write(".setup.patch", d["setup_patch"])
        steps.append("git apply ../.setup.patch && rm ../.setup.patch")
    steps += [f"rm -rf {shlex.quote(p)}" for p in d.get("hidden_tests", [])]
    if d.get("hidden_tests") or d.get("setup_patch"):  # a fresh history: `git log` must hold no answer
        steps.append(f"rm -rf .git && git init -q && git add -A && {GIT} commit -qm base")
    result = sandbox.run(argv=["bash", "-c", " && ".join([*steps, "git rev-parse HEAD"])], timeout=120)
    if not result.ok:
        raise SandboxError(f"could not set up {task.id}: {result.observation()[-500:]}")
    return result.stdout.split()[-1]


def gradable(path: str, base: set[str], test_files: set[str]) -> bool:
    """Whether the agent's change to `path` is graded: not a test or what configures the test run (by name), and
    either a file of the repository at its base commit or a new `.py` file inside one of its packages. A new file
    anywhere else could be read when the tests start (a pytest config under a name of its own, a plugin's
    entry point, a module that shadows the standard library or pytest): a name list cannot cover those, so new
    files are allowed only where nothing is read but what the code under test imports."""
    name = PurePosixPath(path).name
    if path in test_files or name in TEST_CONFIG or name.endswith(("customize.py", ".pth")):
        return False
    if path in base:
        return True
    parent = PurePosixPath(path).parent
    packages = {str(PurePosixPath(f).parent) for f in base if PurePosixPath(f).name == "__init__.py"}
    new_dir = not any(f.startswith(f"{parent}/") for f in base)  # a subpackage the patch adds
    return name.endswith(".py") and (str(parent) in packages or new_dir and str(parent.parent) in packages)


def patch_paths(patch: str) -> set[str]:
    """Every path a git patch names (old and new sides, renames and copies)."""
    paths = set()
    for line in patch.splitlines():
        if line.startswith("diff --git "):
            paths.update(part[2:] for part in line[len("diff --git "):].split(" ") if part[:2] in ("a/", "b/"))
        elif line.startswith(("--- a/", "+++ b/")):
            paths.add(line[6:].strip())
        elif line.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
            paths.add(line.split(" ", 2)[2].strip())
    return paths


def split_patch(patch: str, excluded) -> tuple[str, list[str]]:
    """The patch without the files for which `excluded(path)` holds (any path a file's part names), and the
    left-out paths."""
    parts = patch.split("\ndiff --git ")
    files = [part if i == 0 else "diff --git " + part for i, part in enumerate(parts) if part.strip()]
    kept, left_out = [], []
    for part in files:
        named = patch_paths(part)
        if any(excluded(p) for p in named):
            left_out += sorted(named)
        else:
            kept.append(part if part.endswith("\n") else part + "\n")
    return "".join(kept), sorted(set(left_out))


def single_hunk_edit(patch: str) -> dict[str, str] | None:
    """{"path", "old", "new"} of a patch that changes one hunk of one file (the hunk's two sides, context
    included, which makes `old` unique in practice); None otherwise."""
    lines = patch.splitlines(keepends=True)
    files = [line for line in lines if line.startswith("diff --git ")]
    hunks = [i for i, line in enumerate(lines) if line.startswith("@@")]
    if len(files) != 1 or len(hunks) != 1 or "\\ No newline" in patch:
        return None
    old, new = [], []
    for line in lines[hunks[0] + 1:]:
        tag, text = line[:1], line[1:]
        if tag in (" ", "-"):
            old.append(text)
        if tag in (" ", "+"):
            new.append(text)
    return {"path": files[0].split(" b/", 1)[1].strip(), "old": "".join(old), "new": "".join(new)}
