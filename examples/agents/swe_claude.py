"""Claude Code as it is, fixing a `swe/generated-v0` bug through the gateway: an agent program to train.

`claude -p` (npm `@anthropic-ai/claude-code` 2.1.197, its own system prompt) calls the model at the gateway's
`/v1/messages` (`ANTHROPIC_BASE_URL`: the session's URL without `/v1`). Its tools are Bash, Edit, Read and Write
(`--tools`), allowed without asking (`--allowedTools`; `--dangerously-skip-permissions` refuses to run as root). It
runs on the host in a checkout of the task's repository (`swe_cli.py` says why and how it is graded), with no
sandbox of its own: its commands can reach what this user can. Telemetry and other traffic are off.

Train it with a recipe whose `[agent] program = "examples.agents.swe_claude:solve"` on `env = "swe/generated-v0"`
(`make setup-swe` and `make setup-claude` first), or try it by hand against a gateway:

    agentrl serve gateway --model ~/.cache/agentrl/models/smollm2-135m-instruct --chat-template chatml-tools \\
        --max-total-tokens 8192 &
    python examples/agents/swe_claude.py http://127.0.0.1:8002/sessions/ID/v1     # a session's base_url
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from examples.agents.swe_cli import NPM_BIN, solve_with

from agentrl.envs.swe import SWEEnv
from agentrl.types import Task

CLAUDE = Path(os.environ.get("AGENTRL_CLAUDE", NPM_BIN / "claude"))
CLAUDE_TIMEOUT = float(os.environ.get("AGENTRL_CLAUDE_TIMEOUT", "480"))  # seconds; the program's own timeout is longer
TOOLS = "Bash,Edit,Read,Write"


def claude_command(prompt: str) -> list[str]:
    """`claude -p` on `prompt`, its model `policy`, with its four file and shell tools allowed."""
    return [str(CLAUDE), "-p", prompt, "--model", "policy", "--tools", TOOLS, "--permission-mode", "acceptEdits",
            "--allowedTools", TOOLS.replace(",", " ")]


def solve(task: Task, base_url: str) -> float:
    """One episode: Claude Code on `task` in a host checkout, the model at `base_url`; the graded outcome."""
    def command(checkout: Path, home: Path) -> tuple[list[str], dict[str, str]]:
        return claude_command(task.data["problem_statement"]), {
            "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"), "ANTHROPIC_API_KEY": "agentrl",
            "HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / ".claude"), "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}

    # the model's doing ends the run, graded as at a step limit: a call refused as too long (400), or a reply cut at
    # the gateway's max_tokens (which Claude Code reports as "response exceeded the ... output token maximum")
    return solve_with(task, base_url, "Claude Code", command, CLAUDE_TIMEOUT, lambda code, output: code == 0 or any(
        cause in output for cause in ("API Error: 400", "response exceeded the")))


if __name__ == "__main__":
    print(solve(SWEEnv(split="train").tasks[0], sys.argv[1]))
