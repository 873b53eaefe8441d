"""`agentrl envs attack` (`agentrl/env/attack.py`): the shipped envs hold against every attack, and deliberately weak
envs (a grader that trusts a printed claim, a step that raises, state kept across resets) are reported, each by the
attack meant for it."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import agentrl
import agentrl.env.registry
from agentrl import Message, Task, ToolEnv
from agentrl.cli.main import app
from agentrl.env.api import Score
from agentrl.env.attack import attack
from agentrl.tools import HermesParser, ToolSet, tool

NOTES: list[str] = []  # the leaky env's state: module-level, so it outlives every reset


@tool
def note(text: str) -> str:
    """Write a note.

    Args:
        text: The note.
    """
    NOTES.append(text)
    return "noted"


class WeakEnv(ToolEnv):
    """Asks for 2+2. `flaw` picks its hole: "trusts" a printed claim of success, "raises" on a tool call it cannot
    run, "leaks" notes into the next episode's first message; "" has none."""

    def __init__(self, split="train", flaw=""):
        self.flaw = flaw
        super().__init__(ToolSet([note]), HermesParser(), split=split)

    def load_tasks(self, split):
        return [Task("t0", {"answer": "4"}, split)]

    def first_messages(self, task):
        notes = f" Notes so far: {NOTES}" if self.flaw == "leaks" else ""
        return [Message("user", f"What is 2+2?{notes}")]

    def score(self, task, answer, transcript):
        right = answer.strip() == "4" or (self.flaw == "trusts" and "passed" in answer.lower())
        return Score({"outcome": float(right)})

    def act(self, action):
        if self.flaw == "raises" and "\x00" in action:
            raise RuntimeError("the grader crashed on a NUL byte")
        return super().act(action)

    def gold_actions(self, task):
        return ["<answer>4</answer>"]


for flaw in ("", "trusts", "raises", "leaks"):
    agentrl.register(f"test/weak-{flaw or 'none'}-v0", entry_point=f"{__name__}:WeakEnv", flaw=flaw)


@pytest.mark.parametrize("flaw,hole", [("", None), ("trusts", "forged reports"),
                                       ("raises", "failures turned into errors"),
                                       ("leaks", "state left for the next episode")])
def test_each_weak_env_is_reported_by_the_attack_meant_for_it(flaw, hole):
    findings = attack(lambda: WeakEnv(flaw=flaw), n_tasks=1)
    assert [f.attack for f in findings if not f.held] == ([hole] if hole else [])


def test_the_cli_names_the_hole_and_exits_1():
    result = CliRunner().invoke(app, ["envs", "attack", "test/weak-trusts-v0", "--json"])
    assert result.exit_code == 1
    forged = next(f for f in json.loads(result.stdout) if f["attack"] == "forged reports")
    assert not forged["held"] and "passed" in forged["detail"].lower() and "t0" in forged["detail"]
    assert CliRunner().invoke(app, ["envs", "attack", "test/weak-none-v0"]).exit_code == 0


TASK_FILES = {"harbor/tasks-v0": {"tasks": str(Path(__file__).parent / "data" / "harbor_tasks")}}
WRAPPERS = {"memory/reflexion-v0", "mcp/tools-v0", "openenv/remote-v0", "swe/instances-v0", "verifiers/env-v0",
            "verifiers/v1-v0", "nemo_gym/env-v0"}


def shipped(env_id: str):
    """`env_id` as a test case, with the tier its components need."""
    family = env_id.split("/")[0]
    marks = {"code": [pytest.mark.docker], "swe": [pytest.mark.docker], "harbor": [pytest.mark.docker],
             "web": [pytest.mark.browser],
             "gymnasium": [pytest.mark.slow], "textarena": [pytest.mark.slow], "skyrl": [pytest.mark.slow],
             "verifiers": [pytest.mark.slow]}.get(family, [])
    return pytest.param(env_id, marks=marks, id=env_id)


@pytest.mark.parametrize("env_id", [shipped(e) for e in sorted(agentrl.env.registry.registry())
                                    if not e.startswith(("test/", "web/miniwob-")) and e not in WRAPPERS]
                         + [shipped("web/miniwob-click-checkboxes-v0")])
def test_every_registered_env_holds(env_id):
    """Every env that runs without arguments (the wrappers of another env or of a task file are attacked through
    what they wrap); of MiniWoB's per-task ids, the one whose grader once paid a null policy."""
    n_tasks = 1 if env_id.startswith("web/") else 2  # a browser episode of 40 hostile calls takes a minute
    kwargs = TASK_FILES.get(env_id, {})
    assert [f for f in attack(lambda: agentrl.make(env_id, **kwargs), n_tasks=n_tasks) if not f.held] == []
