"""verifiers 0.4 (`verifiers.v1`) tasksets, in verifiers' own virtualenv: `tests/data/verifiers_reverse_text` is the
package's reverse-text example with its texts inline. As an env (one turn, scored by the task's own reward), and as
an agent program: verifiers' own rollout (its `null` harness) through the gateway, whose trajectories hold exactly
the sampled tokens and verifiers' reward for them, and on which GRPO trains."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import agentrl
from agentrl.env.adapters.verifiers_v1 import VerifiersV1Env, score, solve
from agentrl.gateway.agents import AgentConfig, AgentEngine, AgentEngines
from agentrl.policy import scripted
from agentrl.policy.protocol import SamplingParams
from agentrl.rollout.engine import RolloutConfig
from agentrl.types import Status

PACKAGE = str(Path(__file__).parent / "data" / "verifiers_reverse_text")
TASKSET = {"taskset": {"id": "reverse-text-inline"}, "splits": {"heldout": {"split": "heldout"}},
           "requirements": (PACKAGE,)}
PROGRAM = "agentrl.env.adapters.verifiers_v1:solve"

pytestmark = pytest.mark.slow  # verifiers' virtualenv (about a minute, once) and a process per verifiers call


def reply_for(text: str, k: int) -> str:
    """A reversal with the last `k` characters dropped: LCS rewards below 1 that differ by task."""
    return f"<reversed_text>{text[::-1][:len(text) - k]}</reversed_text>"


def test_a_taskset_is_an_env_whose_turn_verifiers_scores():
    env = agentrl.make("verifiers/v1-v0", **TASKSET)
    heldout = agentrl.make("verifiers/v1-v0", **TASKSET, split="heldout")
    assert len(env.tasks) == 8 and [t.data["prompt"][1]["content"] for t in heldout.tasks][:2] == ["reverse me",
                                                                                                     "policy"]
    task = env.tasks[0]
    obs, _ = env.reset(options={"task": task})
    system = "Reverse the text character-by-character. Put your answer in <reversed_text> tags."
    assert [(m.role, m.content) for m in obs] == [("system", system), ("user", "hello world")]
    _, reward, terminated, _, info = env.step(reply_for("hello world", 1))
    assert terminated and reward == pytest.approx(2 * 10 / 21) and info["reward_components"] == {"lcs": reward}
    with pytest.raises(ValueError, match="taskset needs an 'id'"):
        VerifiersV1Env({})


def test_verifiers_own_rollout_through_the_gateway_keeps_the_sampled_tokens_and_its_reward(renderer):
    """verifiers' rollout of each task (its harness's streamed chat call) through a gateway session: one segment of
    exactly the sampled tokens, and the reward verifiers computed, which equals its score of that reply."""
    env = VerifiersV1Env(**TASKSET, n_tasks=4)
    tasks = list(env.tasks)
    texts = {t.data["prompt"][1]["content"]: k for k, t in enumerate(tasks)}
    policy = scripted.ScriptedPolicy(renderer, lambda prompt, turn: next(
        reply_for(text, k) for text, k in texts.items() if text in prompt), renderer.generation_prompt)
    engine = AgentEngine(solve, policy, renderer, RolloutConfig(group_size=1), AgentConfig(PROGRAM, timeout=300))
    groups = asyncio.run(engine.run(tasks))
    for k, (task, group) in enumerate(zip(tasks, groups)):
        [t] = group.trajectories
        assert t.status is Status.OK and len(t.turns) == 1, t.reason
        reply = renderer.decode(t.token_ids[t.turns[0].start:t.turns[0].end]).removesuffix("<|im_end|>")
        assert reply == reply_for(task.data["prompt"][1]["content"], k)
        assert t.token_ids[:t.prompt_len] == tuple(renderer.prompt_ids(env.first_messages(task)))  # its prompt, as is
        assert t.reward == pytest.approx(score(task, [{"role": "assistant", "content": reply}])["reward"])
    assert [g.trajectories[0].reward for g in groups][0] == 1.0 and len({g.trajectories[0].reward for g in groups}) > 1


def test_grpo_trains_two_steps_on_verifiers_rollouts(tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.policy.hf import HFPolicy
    from agentrl.trainers.methods import grpo
    from agentrl.trainers.rewards import RewardConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = grpo.GRPOConfig(steps=2, tasks_per_step=2, group_size=2, lr=1e-3,
                          reward=RewardConfig(terms={"env": 1.0, "random": 0.5}),  # a coin, so that groups vary
                          rollout=RolloutConfig(max_total_tokens=512, sampling=SamplingParams(max_tokens=16)))
    tasks = list(VerifiersV1Env(**TASKSET).tasks)
    history = grpo.train(cfg, model, tokenizer, HFPolicy(model, tokenizer), None, tasks, tmp_path,
                         engines=AgentEngines(AgentConfig(PROGRAM, timeout=300)))
    assert len(history) == 2
    for metrics in history:
        assert metrics["episodes"] == 4 and metrics["error_frac"] == 0.0 and metrics["sampled_tokens"] > 0
        assert metrics["groups_trained"] >= 1 and "loss" in metrics
