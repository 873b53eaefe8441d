"""Agent programs trained through the gateway: the example program's calls are the math env's prompts token for
token, its runs become groups (errors and timeouts as `error` trajectories), and GRPO trains on them, synchronous
and asynchronous."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.envs.math import ArithmeticEnv
from agentrl.gateway.agents import AgentConfig, AgentEngine, AgentEngines, load_program
from agentrl.policy import scripted
from agentrl.policy.hf import HFPolicy
from agentrl.policy.protocol import SamplingParams
from agentrl.rollout.engine import RolloutConfig
from agentrl.trainers.methods import grpo
from agentrl.types import Status, StopReason, Task

ENV = dict(parser="react", kinds=["expression"], max_ops=2)


def engine(program, policy, renderer, **agent) -> AgentEngine:
    agent = AgentConfig("examples.agents.calculator_openai:solve", tool_parser="react", **agent)
    return AgentEngine(program, policy, renderer, RolloutConfig(group_size=2), agent)


def test_the_example_program_sees_the_envs_prompts_and_earns_its_rewards(renderer):
    env = ArithmeticEnv(**ENV)
    tasks = list(env.tasks)[:4]
    policy = scripted.ScriptedPolicy(renderer, scripted.playing({t.data["question"]: env.gold_actions(t)
                                                                 for t in tasks}), renderer.generation_prompt)
    prompts = []
    generate = policy.generate

    async def recording(prompt_ids, sampling):
        prompts.append(tuple(prompt_ids))
        return await generate(prompt_ids, sampling)

    policy.generate = recording
    groups = asyncio.run(engine(load_program("examples.agents.calculator_openai:solve"), policy, renderer)
                         .run(tasks))
    assert [len(g.trajectories) for g in groups] == [2] * 4
    for task, group in zip(tasks, groups):
        env_prompt = tuple(renderer.prompt_ids(env.first_messages(task), env.tool_schemas))
        for t in group.trajectories:
            assert t.status is Status.OK and t.reward == 1.0 and len(t.turns) == 2 and t.task_id == task.id
            assert t.token_ids[:t.prompt_len] == env_prompt  # the example's prompt is the env's, token for token
            assert tuple(t.token_ids[:t.turns[1].start]) in prompts  # the second call saw exactly this context
            assert sum(t.loss_mask) == sum(t.end - t.start for t in t.turns)
            assert "= 10" in renderer.decode(t.token_ids) or t.metrics["calls"] == 2
    assert len({t.session for g in groups for t in g.trajectories}) == 8


def test_failed_runs_are_errors_with_the_reason(renderer):
    async def raises(task, base_url):
        raise ConnectionError("the agent's own backend is down")

    async def slow(task, base_url):
        await asyncio.sleep(30)

    def silent(task, base_url):  # a plain function: it runs in a thread
        return None

    async def wordy(task, base_url):
        return "correct"

    task = Task("t", {"question": "Compute 1 + 1.", "answer": "2"})
    policy = scripted.ScriptedPolicy(renderer, lambda prompt, turn: "Final Answer: 2", renderer.generation_prompt)
    reasons = {}
    for name, program, kw in [("raises", raises, {}), ("slow", slow, {"timeout": 0.5}), ("silent", silent, {}),
                              ("wordy", wordy, {})]:
        [group] = asyncio.run(engine(program, policy, renderer, **kw).run([task]))
        assert all(t.status is Status.ERROR for t in group.trajectories)
        reasons[name] = group.trajectories[0].reason
    assert "ConnectionError: the agent's own backend is down" in reasons["raises"]
    assert "agent.timeout" in reasons["slow"] and "returned no reward" in reasons["silent"]
    assert "returned 'correct', not a finite number" in reasons["wordy"]


def test_a_run_that_fails_past_max_total_tokens_is_truncated_and_kept(renderer):
    """A program that talks until the gateway refuses its call (context_length_exceeded) and then raises has run out
    of tokens, as an env episode does: truncated, reward 0, its sampled turns kept; not an error."""
    import openai

    async def chatty(task, base_url):
        async with openai.AsyncOpenAI(base_url=base_url, api_key="agentrl") as client:
            messages = [{"role": "user", "content": task.data["question"]}]
            while True:  # until the call that does not fit raises openai.BadRequestError
                reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=16)
                messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                             {"role": "user", "content": "Go on."}]

    task = Task("t", {"question": "Compute 1 + 1.", "answer": "2"})
    policy = scripted.ScriptedPolicy(renderer, lambda prompt, turn: "Let me think about it.",
                                     renderer.generation_prompt)
    agent = AgentConfig("examples.agents.calculator_openai:solve")
    runs = AgentEngine(chatty, policy, renderer, RolloutConfig(group_size=1, max_total_tokens=160,
                                                                      sampling=SamplingParams(max_tokens=16)), agent)
    [group] = asyncio.run(runs.run([task]))
    [t] = group.trajectories
    assert t.status is Status.TRUNCATED and t.stop is StopReason.MAX_TOTAL_TOKENS and t.reward == 0.0, t.reason
    assert "gateway.max_total_tokens" in t.reason and "BadRequestError" in t.reason
    assert len(t.turns) >= 2 and len(t.token_ids) <= 160
    assert sum(t.loss_mask) == sum(turn.end - turn.start for turn in t.turns)


def test_a_program_that_cannot_be_loaded_fails_at_start_up():
    with pytest.raises(ValueError, match="module:function"):
        AgentConfig("examples.agents.calculator_openai")
    with pytest.raises(ValueError, match="cannot be loaded"):
        AgentConfig("examples.agents.calculator_openai:nope")


@pytest.mark.slow
@pytest.mark.parametrize("max_staleness", [0, 1])
def test_grpo_trains_on_agent_sessions(tiny_model_dir, tmp_path, max_staleness):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    policy = HFPolicy(copy.deepcopy(model) if max_staleness else model, tokenizer)
    cfg = grpo.GRPOConfig(steps=2, tasks_per_step=2, lr=1e-3, max_staleness=max_staleness,
                          group_size=2, rollout=RolloutConfig(max_total_tokens=600,
                                                sampling=SamplingParams(max_tokens=24)))
    agent = AgentConfig("examples.agents.calculator_openai:solve", tool_parser="react", timeout=120)
    tasks = list(ArithmeticEnv(**ENV).tasks)[:8]
    history = grpo.train(cfg, model, tokenizer, policy, None, tasks, tmp_path, engines=AgentEngines(agent))
    assert len(history) == 2
    for metrics in history:
        assert metrics["episodes"] >= 4 and metrics["error_frac"] == 0.0 and metrics["sampled_tokens"] > 0
        assert metrics["groups_trained"] == 2


def test_a_recipe_trains_an_agent_program_and_refuses_what_cannot_run(tiny_model_dir, tmp_path):
    from agentrl.config import load_config
    from agentrl.trainers.job.pipeline import run as run_job
    from agentrl.trainers.job.recipe import TrainJob

    rollout = {"max_total_tokens": 512, "sampling": {"max_tokens": 8, "temperature": 0.0}}
    recipe = {"env": "math/arith-v0", "env_kwargs": ENV, "model": str(tiny_model_dir), "out_dir": str(tmp_path),
              "agent": {"program": "examples.agents.calculator_openai:solve", "tool_parser": "react"},
              "eval": {"n": 3, "rollout": rollout},
              "grpo": {"steps": 1, "tasks_per_step": 2, "minibatch_size": 4, "group_size": 2,
                       "rollout": {**rollout, "sampling": {"max_tokens": 8}}}}
    summary = run_job(load_config(TrainJob, recipe), log=lambda line: None)
    assert summary["before"]["episodes"] == summary["after"]["episodes"] == 3
    assert summary["after"]["valid"] == 3 and summary["after"]["errors"] == 0  # the program's runs, scored by it
    with pytest.raises(ValueError, match=r"\[agent\].*remove \[tango\]"):
        load_config(TrainJob, {**recipe, "tango": {}})


def test_a_program_may_post_its_reward_to_the_session(renderer):
    import httpx

    async def posting(task, base_url):
        from openai import AsyncOpenAI

        async with AsyncOpenAI(base_url=base_url, api_key="agentrl") as client:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2?"}])
        async with httpx.AsyncClient() as http:
            posted = await http.post(base_url.removesuffix("/v1") + "/reward",
                                     json={"reward": 0.25, "components": {"outcome": 0.0}})
            assert posted.status_code == 200, posted.text

    task = Task("t", {"question": "2?", "answer": "2"})
    policy = scripted.ScriptedPolicy(renderer, lambda prompt, turn: "2", renderer.generation_prompt)
    [group] = asyncio.run(engine(posting, policy, renderer).run([task]))
    assert [(t.status, t.reward, t.reward_components) for t in group.trajectories] == [
        (Status.OK, 0.25, {"outcome": 0.0})] * 2


def test_calls_past_max_turns_end_the_session_as_truncated_and_the_program_with_it(renderer):
    """A program that never stops calling (it swallows every error) is an episode out of turns: its call past
    `max_turns` is refused, the session ends as truncated (max_turns, reward 0, its turns kept) and the program is
    cancelled, long before `agent.timeout`."""
    import time

    import openai

    async def endless(task, base_url):
        async with openai.AsyncOpenAI(base_url=base_url, api_key="agentrl", max_retries=0) as client:
            messages = [{"role": "user", "content": task.data["question"]}]
            while True:
                try:
                    reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
                    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                                 {"role": "user", "content": "Go on."}]
                except openai.APIError:
                    await asyncio.sleep(0.01)

    task = Task("t", {"question": "Compute 1 + 1.", "answer": "2"})
    policy = scripted.ScriptedPolicy(renderer, lambda prompt, turn: "Let me see.", renderer.generation_prompt)
    runs = AgentEngine(endless, policy, renderer, RolloutConfig(group_size=1, max_turns=3),
                       AgentConfig("examples.agents.calculator_openai:solve", timeout=120.0))
    start = time.monotonic()
    [group] = asyncio.run(runs.run([task]))
    [t] = group.trajectories
    assert time.monotonic() - start < 30
    assert (t.status, t.stop, t.reward) == (Status.TRUNCATED, StopReason.MAX_TURNS, 0.0), t.reason
    assert "more than max_turns=3 model calls" in t.reason and len(t.turns) == 3 and t.metrics["calls"] == 4


def test_a_program_that_floods_the_gateway_is_an_error_and_leaves_no_process(renderer, tmp_path):
    """A harness that keeps sending calls the gateway refuses (here a CLI in a tight loop, deaf to every answer)
    floods it: its session ends as an error after `FLOOD_REFUSALS` refusals in a row, and `run_cli`, which watches the
    session, kills the CLI there, not at its timeout."""
    import sys
    import time

    from agentrl.gateway.sessions import FLOOD_REFUSALS
    from examples.agents.swe_cli import run_cli

    flooder = tmp_path / "flood.py"
    flooder.write_text(
        "import os, sys, httpx\n"
        f"open({str(tmp_path / 'pid')!r}, 'w').write(str(os.getpid()))\n"
        "while True:\n"
        "    try:\n"
        "        httpx.post(sys.argv[1] + '/chat/completions', json={'model': 'm', 'messages': 'all of them'})\n"
        "    except Exception:\n"
        "        pass\n")

    def program(task, base_url):
        run_cli([sys.executable, str(flooder), base_url], {}, 120.0, tmp_path / "log", tmp_path, session=base_url)
        return 1.0

    task = Task("t", {"question": "2?", "answer": "2"})
    policy = scripted.ScriptedPolicy(renderer, lambda prompt, turn: "2", renderer.generation_prompt)
    runs = AgentEngine(program, policy, renderer, RolloutConfig(group_size=1),
                       AgentConfig("examples.agents.calculator_openai:solve", timeout=120.0))
    start = time.monotonic()
    [group] = asyncio.run(runs.run([task]))
    [t] = group.trajectories
    assert time.monotonic() - start < 30
    assert t.status is Status.ERROR and f"flooded the gateway: {FLOOD_REFUSALS} calls refused in a row" in t.reason
    assert "malformed request" in t.reason
    pid = int((tmp_path / "pid").read_text())
    assert not Path(f"/proc/{pid}").exists()  # killed and reaped
