"""verifiers 0.4 environments (its `v1` API: a taskset's tasks, each with its own rewards and stop hooks, played
by a harness program): `verifiers/v1-v0` with `taskset={"id": "NAME", ...}` (what `vf-eval` takes as `--env.taskset`).

verifiers 0.4 pins `openai<3` and `mcp==2.0.0`, against the trainer's pins, so it lives in a virtualenv of its own
(`agentrl.env.venvs`, made once and cached: verifiers, `uv` for its harness scripts, and `requirements`, e.g. the
taskset's package); everything verifiers does runs there, through `_verifiers_v1_runner.py`, one process per call.
Two ways to train on a taskset:

- **As an env** (`VerifiersV1Env`): the episode is one turn, the task's prompt (its system prompt, then its
  prompt) and the model's reply, scored by the task's own rewards (verifiers' `Task.score` on the reply as the
  trace's one sampled turn). For single-turn tasksets.
- **As an agent program** (`solve`, `[agent] program = "agentrl.env.adapters.verifiers_v1:solve"`): verifiers'
  own rollout (`Env.run_episode`, the `null` harness, a local subprocess runtime), its model calls sent to the
  gateway session, which records their exact tokens; its reward is the trace's. Any taskset whose rewards read
  the trace; multi-turn ones included. Each run installs the harness script's dependencies with `uv` (cached after
  the first).

Not adapted: harnesses other than `null` (bash, codex, ...), runtimes other than a local subprocess, multi-agent
envs (`Env.finalize` rewards), and rewards that need the runtime in the `VerifiersV1Env` scoring (verifiers skips
them when it scores without one; the agent-program path runs them).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from agentrl.env.api import TextEnv
from agentrl.env.venvs import Venv, run_json
from agentrl.types import Message, Task

VERIFIERS = ("verifiers==0.4.0", "uv==0.13.9")
RUNNER = "agentrl.env.adapters._verifiers_v1_runner"


class VerifiersError(RuntimeError):
    """A verifiers rollout that ended in an error (its harness failed)."""


def call(command: str, args: dict[str, Any], requirements: Sequence[str] = (), timeout: float = 600.0) -> Any:
    """`command` of the runner in verifiers' virtualenv (made first if needed), its JSON result."""
    return run_json(Venv(requirements=(*VERIFIERS, *requirements)), ["-m", RUNNER, command, json.dumps(args)],
                    timeout, {"AGENTRL_API_KEY": "agentrl", "PYTHONWARNINGS": "ignore"})


class VerifiersV1Env(TextEnv):
    """A verifiers 0.4 taskset's tasks; an episode is one turn, scored by the task's own rewards. `taskset` is the
    taskset's config for `train`; `splits` the changes to it for other splits (e.g. `{"heldout": {"split":
    "heldout"}}`); `requirements` what the taskset needs installed beside verifiers (its package)."""

    def __init__(self, taskset: dict[str, Any], splits: dict[str, dict[str, Any]] | None = None,
                 requirements: Sequence[str] = (), split: str = "train", n_tasks: int | None = None,
                 timeout: float = 600.0):
        if "id" not in taskset:
            raise ValueError("taskset needs an 'id' (the taskset's name, as `vf-eval` takes it)")
        super().__init__(split=split, max_turns=1)
        self.taskset = {**taskset, **(splits or {}).get(split, {})}
        self.requirements, self.n_tasks, self.timeout = tuple(requirements), n_tasks, timeout

    def load_tasks(self, split: str) -> Sequence[Task]:
        listed = call("tasks", {"taskset": self.taskset}, self.requirements, self.timeout)[:self.n_tasks]
        return [Task(f"verifiers/{self.taskset['id']}/{split}/{i}",
                     {"taskset": self.taskset, "index": i, "prompt": t["prompt"], "requirements": self.requirements,
                      "key": t["key"]}, split) for i, t in enumerate(listed)]

    def first_messages(self, task: Task) -> Sequence[Message]:
        return [Message(m["role"], m["content"]) for m in task.data["prompt"]]

    def act(self, action: str) -> tuple[Sequence[Message], float, bool, dict[str, Any]]:
        scored = score(self.task, [{"role": "assistant", "content": action}], self.timeout)
        return [], scored["reward"], True, {"reward_components": scored["rewards"], "answer": action}

    def gold_actions(self, task: Task) -> list[str]:
        raise NotImplementedError("a verifiers taskset has no gold solution to replay")


def score(task: Task, completion: list[dict[str, str]], timeout: float = 600.0) -> dict[str, Any]:
    """What verifiers' own scoring gives `completion` (chat messages after the task's prompt) on `task` (one of a
    `VerifiersV1Env`'s tasks): `{"reward", "rewards"}`."""
    data = task.data
    return call("score", {"taskset": data["taskset"], "index": data["index"], "completion": completion},
                data["requirements"], timeout)


def solve(task: Task, base_url: str) -> float:
    """verifiers' own rollout of `task` (one of a `VerifiersV1Env`'s tasks), its model the gateway session at
    `base_url`; the trace's reward. A rollout that ends in an error (the harness failed) raises it."""
    data = task.data
    result = call("run", {"taskset": data["taskset"], "index": data["index"], "base_url": base_url,
                          "model": "policy"}, data["requirements"])
    if result["errors"]:
        raise VerifiersError(f"verifiers' rollout failed: {'; '.join(result['errors'])[:1500]}")
    return float(result["reward"])
