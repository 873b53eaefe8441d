"""NeMo Gym environments (`nemo-gym` 0.4): `nemo_gym/env-v0` lists a resources server's example rows as tasks, and
`agentrl.env.adapters.nemo_gym_env:solve`, an `[agent] program`, plays each as NeMo Gym's own episode: its
`simple_agent` calls the model (the Responses API, the episode's gateway session, which records the exact tokens),
runs the tool calls on the resources server, and takes the reward its `/verify` gives.

NeMo Gym 0.4 pins `mcp<2` and `openai<=2.7.2` against the trainer's, and 0.5-0.7 need Python >= 3.13.14, so it
lives in a Python 3.12 virtualenv of its own (`nemo-gym==0.4.0` alone, about 1 GB with Ray, MLflow and wandb; made
once, cached), driven by `_nemo_gym_runner.py`, one process per call. Its servers run there without NeMo Gym's CLI,
head server or Ray (`_nemo_gym_runner.py` says how).

Not adapted: playing a NeMo Gym env turn by turn with agentrl's rollout engine (an episode here is NeMo Gym's own,
through the gateway; `VerifiersV1Env`'s single-turn mode has no counterpart), agents other than `simple_agent`,
resources servers that need Ray or services of their own, and datasets other than the server's example rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from agentrl.env.api import TextEnv
from agentrl.env.venvs import Venv, run_json
from agentrl.types import Message, Task

NEMO_GYM = Venv(python="3.12", requirements=("nemo-gym==0.4.0",), serves=False)
RUNNER = str(Path(__file__).with_name("_nemo_gym_runner.py"))


def call(command: str, args: dict[str, Any], timeout: float = 600.0) -> Any:
    """`command` of the runner in NeMo Gym's virtualenv (made first if needed), its JSON result."""
    return run_json(NEMO_GYM, ["-P", RUNNER, command, json.dumps(args)], timeout, {"PYTHONWARNINGS": "ignore"})


class NemoGymEnv(TextEnv):
    """A NeMo Gym resources server's example rows (`server`, a folder of its `resources_servers`), the same in
    every split. Its episodes run as an agent program (`solve`), NeMo Gym's own; played turn by turn here they
    end at once as an error that says so."""

    def __init__(self, server: str = "example_multi_step", split: str = "train", n_tasks: int | None = None):
        super().__init__(split=split, max_turns=1)
        self.server, self.n_tasks = server, n_tasks

    def load_tasks(self, split: str) -> Sequence[Task]:
        rows = call("rows", {"server": self.server})[:self.n_tasks]
        return [Task(f"nemo_gym/{self.server}/{row.get('id', i)}", {"server": self.server, "row": row}, split)
                for i, row in enumerate(rows)]

    def first_messages(self, task: Task) -> Sequence[Message]:
        return [Message(m["role"], m["content"]) for m in task.data["row"]["responses_create_params"]["input"]]

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        tools = self.task.data["row"]["responses_create_params"].get("tools", []) if self.task else []
        return [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
                for t in tools]

    def act(self, action: str) -> tuple[Sequence[Message], float, bool, dict[str, Any]]:
        raise NotImplementedError("a NeMo Gym episode is NeMo Gym's own: train it as an agent program, "
                                  "[agent] program = \"agentrl.env.adapters.nemo_gym_env:solve\"")

    def gold_actions(self, task: Task) -> list[str]:
        raise NotImplementedError("NeMo Gym's example rows hold no solution to replay")


def solve(task: Task, base_url: str) -> float:
    """NeMo Gym's own episode of `task` (one of a `NemoGymEnv`'s), its model the gateway session at `base_url`;
    the reward its resources server's `/verify` gives."""
    result = call("run", {"server": task.data["server"], "row": task.data["row"], "base_url": base_url})
    return float(result["reward"])
