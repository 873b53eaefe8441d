"""`code/humaneval-v0` and `code/generated-v0`: write a Python function, with a sandbox to try code in.

Tools: `python(code)` runs code in the episode's sandbox and returns its output (stateless: each call is a
fresh interpreter; files in the workspace persist within the episode), `submit(code)` ends the episode with
the solution. The hidden tests run after submit, in a sandbox reset since the episode's last program (no
file, process or shared memory of the episode is left); the agent never sees them. Reward
components: `tests_passed` (the fraction of hidden tests passed, the reward by default) and `outcome`
(1 when all pass). Multi-turn: run, read the error, fix, submit.

`mode = "direct"` is the baseline without tools (one attempt): one turn, no tool offered, and the reply's first
fenced code block (the whole reply when it has none) is the submission, whatever the tool-call format.

Sandboxes come from this process's warm pool (`tools/sandbox/pool.py`): Docker by default, `sandbox =
"local"` for a subprocess runtime that isolates nothing (tests, trusted code). A sandbox that dies is a
`SandboxError`: the episode ends as `error`, never scored 0.
"""

from __future__ import annotations

import random
import re
from typing import Sequence

from agentrl.env.api import Score, ToolEnv
from agentrl.envs.code import tasks as code_tasks
from agentrl.envs.code.harness import run_tests
from agentrl.tools import PARSERS, ParsedAction, ToolSet, tool
from agentrl.envs.docker_ready import require_docker
from agentrl.tools.sandbox import Limits, Runtime
from agentrl.tools.sandbox.pool import shared_pool
from agentrl.types import Message, Task, ToolCall

MODES = ("tools", "direct")
DEMONSTRATIONS = ("submit", "run_then_submit")

SYSTEM_PROMPT = (
    "You write Python functions. Use the python tool to run code and test your ideas; each call runs in a "
    "fresh interpreter and returns what it prints. When your function is right, call submit with its "
    "complete code (imports, the def line and the body). Hidden tests decide the reward.\n{fmt}"
)
DIRECT_PROMPT = ("You write Python functions. Reply with the complete function (imports, the def line and the body) "
                 "in one ```python code block. Hidden tests decide the reward.")
_FENCED = re.compile(r"```[\w+-]*[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)  # an unclosed block runs to the end


class CodeEnv(ToolEnv):
    """Write a Python function: try code with the `python` tool, `submit` it, and hidden tests score it.

    `source` picks the tasks ("humaneval" or "generated"), `sandbox` the runtime ("docker", or "local", which
    isolates nothing). Only the `hermes` parser is accepted (code spans lines); another raises ValueError.
    `mode` "tools" (default; up to 6 turns) or "direct" (one reply, no tools: the baseline). `templates` keeps the
    generated functions of those templates only (e.g. SFT demonstrations of some, RL on all). `demonstrations`:
    the expert of SFT warm starts submits the reference solution at once ("submit"), or first runs it with the
    `python` tool on one example input and reads its output ("run_then_submit", generated functions only).
    """

    def __init__(self, source: str = "humaneval", split: str = "train", n_tasks: int | None = None, seed: int = 0,
                 parser: str = "hermes", max_turns: int | None = None, max_invalid: int = 3, sandbox: str = "docker",
                 timeout: float = 10.0, memory_mb: int = 512, pool_size: int = 8, mode: str = "tools",
                 templates: Sequence[str] | None = None, demonstrations: str = "submit"):
        if parser not in ("hermes",):
            raise ValueError(f"the code env reads Hermes tool calls (code spans lines); got parser {parser!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "direct" and max_turns not in (None, 1):
            raise ValueError(f"mode='direct' is one reply: remove max_turns (got {max_turns}) or use mode='tools'")
        if demonstrations not in DEMONSTRATIONS:
            raise ValueError(f"demonstrations must be one of {DEMONSTRATIONS}, got {demonstrations!r}")
        if demonstrations == "run_then_submit" and (mode != "tools" or source != "generated"):
            raise ValueError("demonstrations='run_then_submit' runs an example input of a generated function with the "
                             f"python tool: it needs source='generated' and mode='tools' (got {source!r}, {mode!r})")
        self.source, self.n_tasks, self.task_seed, self.mode = source, n_tasks, seed, mode
        self.demonstrations = demonstrations
        self.templates = None if templates is None else tuple(templates)
        self.sandbox_kind, self.pool_size = sandbox, pool_size
        self.max_concurrent_episodes = pool_size  # each holds a sandbox of this process's pool while it runs code
        self.limits = Limits(timeout=timeout, memory_mb=memory_mb)
        self._sandbox: Runtime | None = None

        @tool(timeout=timeout + 30.0)
        def python(code: str) -> str:
            """Run Python code in a sandbox and return its output.

            Args:
                code: A complete Python program; print what you want to see.
            """
            return self.sandbox.run(code=code).observation()

        @tool(timeout=1.0)
        def submit(code: str) -> str:
            """Submit the final solution; the episode ends and hidden tests score it.

            Args:
                code: The complete function definition (with any imports it needs).
            """
            return code

        tools = ToolSet([python, submit] if mode == "tools" else [])
        if max_turns is None:
            max_turns = 6 if mode == "tools" else 1
        super().__init__(tools, PARSERS[parser](), split=split, max_turns=max_turns,
                         max_invalid=max_invalid, reward_weights={"tests_passed": 1.0},
                         answer_tool="submit" if mode == "tools" else None)

    def check_ready(self) -> None:
        """The Docker daemon answers (the `local` runtime needs nothing)."""
        if self.sandbox_kind == "docker":
            require_docker("the code env runs its tools in Docker")

    @property
    def sandbox(self) -> Runtime:
        """This episode's sandbox, leased from the pool on first use."""
        if self._sandbox is None:
            self._sandbox = shared_pool(self.sandbox_kind, self.limits, self.pool_size).acquire()
        return self._sandbox

    def _release(self) -> None:
        if self._sandbox is not None:
            sandbox, self._sandbox = self._sandbox, None
            shared_pool(self.sandbox_kind, self.limits, self.pool_size).release(sandbox)

    def on_reset(self, task: Task) -> None:
        super().on_reset(task)
        self._release()

    def close(self) -> None:
        self._release()
        super().close()

    def load_tasks(self, split: str) -> Sequence[Task]:
        """`n_tasks` tasks of `split` from `source` (by default all of HumanEval's, or 1000 generated for train, 200
        otherwise)."""
        return code_tasks.load(self.source, split, self.n_tasks, self.task_seed, self.templates)

    def first_messages(self, task: Task) -> Sequence[Message]:
        """The system prompt (with the parser's format instructions, but for direct) and the function's stub."""
        system = DIRECT_PROMPT if self.mode == "direct" else SYSTEM_PROMPT.format(fmt=self.parser.instructions)
        return (Message("system", system),
                Message("user", f"Complete this function:\n\n```python\n{task.data['prompt']}```"))

    def act(self, action: str):
        if self.mode == "tools":
            return super().act(action)
        found = _FENCED.search(action)  # direct: the reply's code is the submission, in whatever format
        obs, reward, done, info = self._finish(found.group(1) if found else action)
        return obs, reward, done, {**info, "assistant": Message("assistant", action)}

    def score(self, task: Task, answer: str, transcript: Sequence[ParsedAction]) -> Score:
        d = task.data
        self._release()  # graded in a reset sandbox: nothing the episode's programs left behind takes part
        report = run_tests(self.sandbox, d["prompt"], answer, d["entry_point"], d["test"], self.limits.timeout)
        detail = f"{report.passed}/{report.total} hidden tests" + (f"; {report.error}" if report.error else "")
        return Score({"tests_passed": report.fraction, "outcome": float(report.passed == report.total)}, detail)

    def difficulty(self, task: Task) -> dict[str, str]:
        """A generated function's template, so that evaluations report success per template."""
        return {"template": task.data["template"]} if "template" in task.data else {}

    def solution(self, task: Task) -> str:
        """The reference solution: the task's prompt (signature and docstring) followed by the canonical body."""
        return task.data["prompt"] + task.data["canonical_solution"]

    def gold_actions(self, task: Task) -> list[str]:
        return [self._submission(self.solution(task))]

    def demonstration(self, task: Task, rng: random.Random, error_rate: float = 0.0) -> list[str]:
        """The gold submission, after a run of it on one example input with `demonstrations="run_then_submit"`;
        with probability `error_rate`, the unfinished stub instead (it fails)."""
        if rng.random() < error_rate:
            return [self._submission(task.data["prompt"] + "    pass\n")]
        if self.demonstrations == "submit":
            return self.gold_actions(task)
        args = ", ".join(map(repr, code_tasks.example_input(task, rng)))
        run = f"{self.solution(task)}\nprint({task.data['entry_point']}({args}))\n"
        return [self.parser.format_call(ToolCall("python", {"code": run})), *self.gold_actions(task)]

    def _submission(self, code: str) -> str:
        """`code` submitted as the mode asks: a `submit` call, or (direct) a fenced block."""
        return f"```python\n{code}```" if self.mode == "direct" else \
            self.parser.format_call(ToolCall("submit", {"code": code}))
