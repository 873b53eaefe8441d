"""Codex CLI as it is, fixing a `swe/generated-v0` bug through the gateway: an agent program to train.

`codex exec` (npm `@openai/codex` 0.171, its own prompts and tools: `exec_command`, `write_stdin`, ...) calls the model
at the gateway's `/v1/responses`. Its multi-agent, goal and web-search tools are switched off: a policy behind the
gateway can only call function tools, and the gateway refuses the others by name. It runs on the host in a checkout
of the task's repository (`swe_cli.py` says why and how it is graded), inside Codex's own sandbox (`--sandbox
workspace-write`: its commands write only the checkout and reach no network).

Train it with a recipe whose `[agent] program = "examples.agents.swe_codex:solve"` on `env = "swe/generated-v0"`
(`make setup-swe` and `make setup-codex` first), or try it by hand against a gateway:

    agentrl serve gateway --model ~/.cache/agentrl/models/smollm2-135m-instruct --chat-template chatml-tools \\
        --max-total-tokens 8192 &
    python examples/agents/swe_codex.py http://127.0.0.1:8002/sessions/ID/v1     # a session's base_url
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from examples.agents.swe_cli import NPM_BIN, solve_with

from agentrl.envs.swe import SWEEnv
from agentrl.types import Task

CODEX = Path(os.environ.get("AGENTRL_CODEX", NPM_BIN / "codex"))
CODEX_TIMEOUT = float(os.environ.get("AGENTRL_CODEX_TIMEOUT", "480"))  # seconds; the program's own timeout is longer


def codex_command(base_url: str, checkout: Path, prompt: str) -> list[str]:
    """`codex exec` on `prompt` in `checkout`, its model `policy` at the gateway session `base_url`."""
    provider = f'{{name="agentrl", base_url="{base_url}", wire_api="responses", env_key="AGENTRL_API_KEY"}}'
    return [str(CODEX), "exec", "--skip-git-repo-check", "-C", str(checkout), "-m", "policy",
            "-c", 'model_provider="agentrl"', "-c", f"model_providers.agentrl={provider}",
            "--disable", "multi_agent", "--disable", "goals", "-c", 'web_search="disabled"',
            "--sandbox", "workspace-write", prompt]


def solve(task: Task, base_url: str) -> float:
    """One episode: Codex on `task` in a host checkout, the model at `base_url`; the graded outcome."""
    def command(checkout: Path, home: Path) -> tuple[list[str], dict[str, str]]:
        return (codex_command(base_url, checkout, task.data["problem_statement"]),
                {"CODEX_HOME": str(home), "AGENTRL_API_KEY": "agentrl"})

    return solve_with(task, base_url, "Codex CLI", command, CODEX_TIMEOUT,
                      lambda code, output: code == 0 or "tokens used" in output)  # Codex's summary of a run


if __name__ == "__main__":
    print(solve(SWEEnv(split="train").tasks[0], sys.argv[1]))
