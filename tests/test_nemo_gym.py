"""NeMo Gym 0.4 in its own Python 3.12 virtualenv: its `example_multi_step` resources server's rows as tasks, each
episode NeMo Gym's own (`simple_agent` → the Responses API of a gateway session → the server's tools → its
`/verify`), recorded with exactly the sampled tokens and trained on."""

from __future__ import annotations

import asyncio
import json

import pytest

from agentrl.env.adapters.nemo_gym_env import NemoGymEnv, solve
from agentrl.gateway.agents import AgentConfig, AgentEngine, AgentEngines
from agentrl.policy import scripted
from agentrl.policy.protocol import SamplingParams
from agentrl.rollout.engine import RolloutConfig
from agentrl.types import Status

PROGRAM = "agentrl.env.adapters.nemo_gym_env:solve"
pytestmark = pytest.mark.slow  # NeMo Gym's virtualenv (about 1 GB, once) and its servers started per episode


def tool_call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def value(synonym: str) -> int:
    return sum(map(ord, synonym))  # what example_multi_step's get_synonym_value returns


def episode(renderer, task, replies: list[str]):
    """NeMo Gym's episode of `task` with a policy that replies `replies` in turn; its trajectories and the
    prompts the policy was given."""
    prompts = []

    def respond(prompt: str, turn: int) -> str:
        prompts.append(prompt)
        return replies[min(turn, len(replies) - 1)]

    policy = scripted.ScriptedPolicy(renderer, respond, renderer.generation_prompt)
    rollout = RolloutConfig(group_size=1, max_total_tokens=16384, sampling=SamplingParams(max_tokens=256))
    engine = AgentEngine(solve, policy, renderer, rollout, AgentConfig(PROGRAM, timeout=300))
    [group] = asyncio.run(engine.run([task]))
    return group.trajectories, prompts


def test_nemo_gyms_own_episode_runs_through_the_gateway_with_its_reward(renderer):
    env = NemoGymEnv(n_tasks=1)
    [task] = env.tasks
    row = task.data["row"]
    assert [m.role for m in env.first_messages(task)] == ["system", "user"] and row["expected_synonyms"] == [
        "Blazing", "Warm"]
    for order, reward in ((1, 1.0), (-1, 0.0)):  # the values in the order asked, then reversed
        expected = row["expected_synonyms"]
        replies = [*(tool_call("get_synonym_value", {"synonym": s}) for s in expected),
                   tool_call("extract_synonym_values", {"synonym_values": [value(s) for s in expected][::order]}),
                   "Done."]
        [t], prompts = episode(renderer, task, replies)
        assert (t.status, t.reward) == (Status.OK, reward), t.reason
        assert len(t.turns) == 4 and sum(t.loss_mask) == sum(turn.end - turn.start for turn in t.turns)
        assert '"synonym_value":711' in prompts[1].replace(" ", "")  # the server's tool result, seen by the policy
        for turn, sampled in zip(t.turns, replies):
            assert renderer.decode(t.token_ids[turn.start:turn.end]).startswith(sampled)  # the replies, as sampled


def test_grpo_trains_on_nemo_gym_episodes(long_tiny_model_dir, tmp_path_factory):
    """The tiny model built with 16,384 positions (the env's system prompt lists 300 synonyms), two GRPO steps on
    NeMo Gym's episodes, with a coin beside the reward so that the group varies."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.policy.hf import HFPolicy
    from agentrl.trainers.methods import grpo
    from agentrl.trainers.rewards import RewardConfig

    tokenizer = AutoTokenizer.from_pretrained(long_tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(long_tiny_model_dir, dtype=torch.float32)
    cfg = grpo.GRPOConfig(steps=2, tasks_per_step=1, group_size=2, lr=1e-3,
                          reward=RewardConfig(terms={"env": 1.0, "random": 0.5}),
                          rollout=RolloutConfig(max_total_tokens=16384, sampling=SamplingParams(max_tokens=16)))
    history = grpo.train(cfg, model, tokenizer, HFPolicy(model, tokenizer), None, list(NemoGymEnv().tasks),
                         tmp_path_factory.mktemp("run"), engines=AgentEngines(AgentConfig(PROGRAM, timeout=300)))
    assert len(history) == 2
    for metrics in history:
        assert metrics["episodes"] == 2 and metrics["error_frac"] == 0.0 and metrics["sampled_tokens"] > 0
