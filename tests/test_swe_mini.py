"""mini-swe-agent as an agent program (examples/agents/swe_mini.py): its calls go through the gateway, its commands
into the SWE env's sandbox, its repository is graded as `swe/generated-v0` grades; a scripted policy makes it run
fixed commands."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.envs.swe import SWEEnv
from agentrl.envs.swe.generate import INSTANCES
from agentrl.gateway.agents import AgentConfig, AgentEngine, load_program
from agentrl.policy import scripted
from agentrl.policy.protocol import SamplingParams
from agentrl.rollout.engine import RolloutConfig
from agentrl.types import Status, StopReason
from conftest import record_calls

PROGRAM = "examples.agents.swe_mini:solve"


def command(text: str) -> str:
    return f"THOUGHT: the next step.\n\n```mswea_bash_command\n{text}\n```"


def play(renderer, task, replies: list[str], max_total_tokens: int = 8192):
    """One run of mini-swe-agent on `task` with a policy that replies `replies` in turn (the last one again)."""
    policy = scripted.ScriptedPolicy(renderer, lambda prompt, turn: replies[min(turn, len(replies) - 1)],
                                     renderer.generation_prompt)
    prompts = record_calls(policy)
    rollout = RolloutConfig(group_size=1, max_total_tokens=max_total_tokens, sampling=SamplingParams(max_tokens=512))
    engine = AgentEngine(load_program(PROGRAM), policy, renderer, rollout, AgentConfig(PROGRAM, timeout=300))
    [group] = asyncio.run(engine.run([task]))
    return group.trajectories, prompts


@pytest.fixture(scope="module")
def task():
    assert INSTANCES.exists(), f"no generated SWE tasks at {INSTANCES}: run `agentrl swe generate`"
    env = SWEEnv(split="train", n_tasks=1)
    yield env.tasks[0]
    env.close()


@pytest.mark.docker
def test_mini_swe_agent_fixes_the_bug_through_the_gateway_with_exact_tokens(renderer, task):
    fix = f"cat > /tmp/fix.patch <<'AGENTRL_PATCH'\n{task.data['patch']}AGENTRL_PATCH\ngit apply /tmp/fix.patch"
    trajectories, calls = play(renderer, task, [command(fix), command("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")])
    [t] = trajectories  # mini-swe-agent's history only grows: one segment
    assert t.status is Status.OK and t.reward == 1.0, t.reason
    assert len(t.turns) == len(calls) == 2
    for turn, (prompt, sampled) in zip(t.turns, calls):  # each call's context and reply, token for token
        assert tuple(t.token_ids[:turn.start]) == prompt and tuple(t.token_ids[turn.start:turn.end]) == sampled
    assert sum(t.loss_mask) == sum(turn.end - turn.start for turn in t.turns)
    assert task.data["problem_statement"][:60] in renderer.decode(t.token_ids[:t.prompt_len])


@pytest.mark.docker
def test_mini_swe_agent_that_changes_nothing_is_graded_zero_and_one_that_never_submits_ends(renderer, task):
    [t], _ = play(renderer, task, [command("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")])
    assert t.status is Status.OK and t.reward == 0.0
    [t], calls = play(renderer, task, [command("ls")])  # never submits: its step limit ends it, and it is graded
    assert t.status is Status.OK and t.reward == 0.0 and len(calls) == 12
    # a call past the context: the gateway refuses it, the run ends there, graded; truncated, as the env's would be
    [t], calls = play(renderer, task, [command("ls")], max_total_tokens=len(calls[2][0]) + 100)
    assert t.status is Status.TRUNCATED and t.stop is StopReason.MAX_TOTAL_TOKENS and t.reward == 0.0, t.reason
    assert 2 <= len(calls) < 12


@pytest.mark.docker
@pytest.mark.slow
def test_grpo_trains_on_mini_swe_agent_sessions(tiny_model_dir, tmp_path, task):
    """The tiny model behind the gateway: mini-swe-agent's runs (format errors, a context that fills up) are
    graded, recorded and trained: a GRPO step with a random reward term beside the env's, so that groups vary."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.gateway.agents import AgentEngines
    from agentrl.policy.hf import HFPolicy
    from agentrl.trainers.methods import grpo
    from agentrl.trainers.rewards import RewardConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = grpo.GRPOConfig(steps=1, tasks_per_step=1, group_size=2, lr=1e-3,
                          reward=RewardConfig(terms={"env": 1.0, "random": 0.5}),
                          rollout=RolloutConfig(max_total_tokens=2048, sampling=SamplingParams(max_tokens=24)))
    engines = AgentEngines(AgentConfig(PROGRAM, timeout=300))
    [metrics] = grpo.train(cfg, model, tokenizer, HFPolicy(model, tokenizer), None, [task], tmp_path, engines=engines)
    assert metrics["episodes"] == 2 and metrics["error_frac"] == 0.0 and metrics["sampled_tokens"] > 0
    assert metrics["groups_trained"] == 1 and "loss" in metrics
