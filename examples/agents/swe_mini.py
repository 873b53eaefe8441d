"""mini-swe-agent as it is, fixing a `swe/generated-v0` bug through the gateway: an agent program to train.

mini-swe-agent (`minisweagent.agents.default.DefaultAgent`, its own `mini_textbased.yaml` prompts: one bash command
in a ```mswea_bash_command block per reply) talks to the model through litellm's OpenAI-compatible provider at
`base_url`, and runs its commands in the task's Docker sandbox: the SWE env leases the sandbox, sets the repository
up, and after the agent submits (or stops) grades the repository as `swe/generated-v0` does (hidden tests, SWE-bench's
rule). Nothing here knows about training. Why the commands run in the env's sandbox rather than in mini-swe-agent's
own `DockerEnvironment`: the env's sandboxes are pooled, limited (memory, processes, no network) and reset between
episodes, and its grader reads the repository they leave.

Train it with a recipe whose `[agent] program = "examples.agents.swe_mini:solve"` on `env = "swe/generated-v0"`
(`make setup-swe` first), or try it by hand against a gateway:

    agentrl serve gateway --model ~/.cache/agentrl/models/smollm2-135m-instruct &
    python examples/agents/swe_mini.py http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")  # no banner on import
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # offline: no fetch of litellm's price list
os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")  # the gateway is local: a failed call fails the turn

import litellm  # noqa: E402
from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.config import get_config_from_spec  # noqa: E402
from minisweagent.exceptions import Submitted  # noqa: E402
from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel  # noqa: E402

from agentrl.envs.swe import SWEEnv  # noqa: E402
from agentrl.envs.swe.env import REPO  # noqa: E402
from agentrl.types import Task  # noqa: E402

STEP_LIMIT = 12  # model calls per episode: a small model that never submits still ends, and is graded
SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class SandboxEnvironment:
    """mini-swe-agent's environment protocol over an agentrl sandbox: each command in a fresh bash, in the
    repository, under the sandbox's limits; the submit line ends the run, as its `LocalEnvironment` does."""

    def __init__(self, env: SWEEnv, timeout: float = 30.0):
        self.env, self.timeout = env, timeout

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        result = self.env.sandbox.run(argv=["bash", "-c", f"cd {cwd or REPO} && {action.get('command', '')}"],
                                      timeout=timeout or self.timeout)
        output = {"output": result.stdout + result.stderr,
                  "returncode": -1 if result.exit_code is None else result.exit_code,
                  "exception_info": f"killed after {result.seconds:.0f} s" if result.timed_out else ""}
        lines = output["output"].lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT and output["returncode"] == 0:
            raise Submitted({"role": "exit", "content": "".join(lines[1:]),
                             "extra": {"exit_status": "Submitted", "submission": "".join(lines[1:])}})
        return output

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return {**platform.uname()._asdict(), **kwargs}

    def serialize(self) -> dict:
        return {"info": {"config": {"environment_type": f"{__name__}.SandboxEnvironment"}}}


def solve(task: Task, base_url: str) -> float:
    """One episode: mini-swe-agent on `task` in its sandbox, the model at `base_url`; the graded outcome."""
    config = get_config_from_spec("mini_textbased.yaml")
    env = SWEEnv(split=task.split)
    try:
        env.reset(options={"task": task})
        model = LitellmTextbasedModel(model_name="openai/policy", cost_tracking="ignore_errors",
                                      model_kwargs={"api_base": base_url, "api_key": "none", "drop_params": True},
                                      **{k: v for k, v in config.get("model", {}).items()
                                         if k in ("observation_template", "format_error_template")})
        agent = DefaultAgent(model, SandboxEnvironment(env),
                             **{**config["agent"], "step_limit": STEP_LIMIT, "cost_limit": 0.0})
        try:
            agent.run(task.data["problem_statement"])
        except litellm.exceptions.ContextWindowExceededError:  # the gateway refused a call past the context
            pass  # the run is over and its repository graded, as at the step limit; any other failure is an error
        return env.score(task, "", []).components["outcome"]
    finally:
        env.close()


if __name__ == "__main__":
    train = SWEEnv(split="train")
    print(solve(train.tasks[0], sys.argv[1]))
