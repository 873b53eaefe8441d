"""Coding-agent CLIs as agent programs (`examples/agents/swe_codex.py`, `swe_claude.py`): the real Codex CLI (npm
@openai/codex 0.171, `make setup-codex`) and Claude Code (npm @anthropic-ai/claude-code 2.1.197, `make setup-claude`)
call the gateway's /v1/responses and /v1/messages, run their commands in a host checkout of a `swe/generated-v0`
task, and the repository they leave is graded in the SWE env's sandbox. A scripted policy makes a CLI run a fixed
command."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from examples.agents import swe_claude, swe_codex

from agentrl.envs.swe import SWEEnv
from agentrl.envs.swe.generate import INSTANCES
from agentrl.gateway.agents import AgentConfig, AgentEngine, load_program
from agentrl.policy import scripted
from agentrl.policy.protocol import SamplingParams
from agentrl.rollout.engine import RolloutConfig
from agentrl.types import Status
from conftest import record_calls


@dataclass(frozen=True)
class CLI:
    name: str
    module: object
    binary: Path
    timeout_setting: str  # the module's timeout constant
    package: str  # in the command lines of the processes it starts from its package (Codex's native binary)
    shell_tool: str  # its shell tool's name and argument
    shell_argument: str

    @property
    def program(self) -> str:
        return f"{self.module.__name__}:solve"

    def leftovers(self) -> list[int]:
        """Its processes still running: started as `binary` (the path as run, not the file it links to), or from
        its package."""
        return processes(str(self.binary)) + processes(self.package)

    def shell(self, command: str) -> str:
        """The policy's reply that makes the CLI run `command` (a Hermes tool call; the gateway turns it into the
        protocol's own tool call)."""
        call = {"name": self.shell_tool, "arguments": {self.shell_argument: command}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


CLIS = [CLI("Codex CLI", swe_codex, swe_codex.CODEX, "CODEX_TIMEOUT", "@openai/codex", "exec_command", "cmd"),
        CLI("Claude Code", swe_claude, swe_claude.CLAUDE, "CLAUDE_TIMEOUT", "claude-code", "Bash", "command")]


@pytest.fixture(params=CLIS, ids=lambda cli: cli.name)
def cli(request) -> CLI:
    assert request.param.binary.exists(), f"no {request.param.name} at {request.param.binary}: run `make test`'s setup"
    return request.param


@pytest.fixture(scope="module")
def task():
    assert INSTANCES.exists(), f"no generated SWE tasks at {INSTANCES}: run `agentrl swe generate`"
    env = SWEEnv(split="train", n_tasks=1)
    yield env.tasks[0]
    env.close()


def play(cli: CLI, renderer, task, replies: list):
    """One run of `cli` on `task` with a policy that replies `replies` in turn (the last one again; a function is
    called for its reply)."""
    def respond(prompt: str, turn: int) -> str:
        reply = replies[min(turn, len(replies) - 1)]
        return reply() if callable(reply) else reply

    policy = scripted.ScriptedPolicy(renderer, respond, renderer.generation_prompt)
    calls = record_calls(policy)
    rollout = RolloutConfig(group_size=1, max_total_tokens=16384, sampling=SamplingParams(max_tokens=1024))
    engine = AgentEngine(load_program(cli.program), policy, renderer, rollout, AgentConfig(cli.program, timeout=600))
    [group] = asyncio.run(engine.run([task]))
    return group.trajectories, calls


def processes(marker: str) -> list[int]:
    """Processes whose command line holds `marker` (a CLI's package, or a command it ran)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.docker
@pytest.mark.slow
def test_the_cli_fixes_the_bug_through_the_gateway_with_exact_tokens(cli, renderer, task):
    fix = f"cat > /tmp/fix.patch <<'AGENTRL_PATCH'\n{task.data['patch']}AGENTRL_PATCH\ngit apply /tmp/fix.patch"
    trajectories, calls = play(cli, renderer, task, [cli.shell(fix), "Fixed the bug."])
    [t] = trajectories  # the CLI sends its history back whole: the tool call, its output, then the answer extend it
    assert t.status is Status.OK and t.reward == 1.0, t.reason
    assert len(t.turns) == len(calls) >= 2
    for turn, (prompt, sampled) in zip(t.turns, calls):  # each call's context and reply, token for token
        assert tuple(t.token_ids[:turn.start]) == prompt and tuple(t.token_ids[turn.start:turn.end]) == sampled
    assert sum(t.loss_mask) == sum(turn.end - turn.start for turn in t.turns)
    assert cli.leftovers() == []


@pytest.mark.docker
@pytest.mark.slow
def test_a_cli_that_changes_nothing_scores_zero_and_one_that_hangs_is_an_error(cli, renderer, task, monkeypatch):
    [t, *_], _ = play(cli, renderer, task, ["Nothing to change."])
    assert t.status is Status.OK and t.reward == 0.0, t.reason
    monkeypatch.setattr(cli.module, cli.timeout_setting, 20.0)
    trajectories, _ = play(cli, renderer, task, [cli.shell("sleep 611")])  # it waits on it, and on it again
    assert trajectories and all(t.status is Status.ERROR for t in trajectories)
    assert f"{cli.name} ran past 20 s and was killed" in trajectories[0].reason
    assert cli.leftovers() == [] and processes("sleep 611") == []  # the CLI, and what it started


@pytest.mark.docker
@pytest.mark.slow
def test_a_cli_that_crashes_is_an_error_with_its_exit_code_and_leaves_nothing(cli, renderer, task):
    """The CLI's first process dies (SIGKILL) while its second call is sampled; what it started (Codex's native
    binary, its child) runs on: an `error` episode that says so, and nothing left. (Not killed by a command of the
    policy's: Codex's sandbox keeps its commands from seeing its own processes.)"""
    def crash() -> str:
        for pid in processes(str(cli.binary)):
            os.kill(pid, signal.SIGKILL)
        return "Done."

    trajectories, _ = play(cli, renderer, task, [cli.shell("true"), crash])
    assert trajectories and all(t.status is Status.ERROR for t in trajectories)
    assert f"{cli.name} failed (exit code -9) before its run ended" in trajectories[0].reason
    assert cli.leftovers() == []


@pytest.mark.docker
@pytest.mark.slow
def test_a_reply_cut_at_max_tokens_ends_the_run_graded_not_as_an_error(cli, renderer, task):
    """The CLI gives up on a reply the gateway cut (Codex: "Incomplete response", Claude Code: "response exceeded the
    output token maximum"): the model's doing, so the repository is graded, as at a step limit."""
    [t, *_], calls = play(cli, renderer, task, ["word " * 2000])
    assert t.status is not Status.ERROR and t.reward == 0.0, t.reason
    assert len(calls[0][1]) == 1024  # cut at the rollout's max_tokens


@pytest.mark.docker
@pytest.mark.slow
def test_grpo_trains_on_the_clis_sessions(cli, long_tiny_model_dir, tmp_path_factory, task):
    """The tiny model, built with 16,384 positions (Codex's first prompt is 11,700 of its tokens, past the usual
    2,048), behind the gateway: the CLI's runs are graded, recorded and trained, a GRPO step with a random reward term
    (a coin per episode) beside the env's, so that the group varies. (SmolLM2 took 12 GB of memory for this step.)"""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.gateway.agents import AgentEngines
    from agentrl.policy.hf import HFPolicy
    from agentrl.trainers.methods import grpo
    from agentrl.trainers.rewards import RewardConfig

    tokenizer = AutoTokenizer.from_pretrained(long_tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(long_tiny_model_dir, dtype=torch.float32)
    cfg = grpo.GRPOConfig(steps=1, tasks_per_step=1, group_size=4, lr=1e-3,
                          reward=RewardConfig(terms={"env": 1.0, "random": 0.5}),
                          rollout=RolloutConfig(max_total_tokens=16384, sampling=SamplingParams(max_tokens=24)))
    engines = AgentEngines(AgentConfig(cli.program, timeout=600))
    tmp_path = tmp_path_factory.mktemp("run")
    [metrics] = grpo.train(cfg, model, tokenizer, HFPolicy(model, tokenizer), None, [task], tmp_path, engines=engines)
    assert metrics["episodes"] == 4 and metrics["error_frac"] == 0.0 and metrics["sampled_tokens"] > 0
    assert metrics["groups_trained"] == 1 and "loss" in metrics
    assert cli.leftovers() == []
