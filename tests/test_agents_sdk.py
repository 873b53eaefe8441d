"""An agent written with the OpenAI Agents SDK, used as its users write it, trained through the gateway: the SDK's
requests are accepted, its tool calls round-trip, and a session with a sub-agent records one exact-token segment per
prompt."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from agents.models.chatcmpl_converter import Converter

from agentrl.envs.math import ArithmeticEnv
from agentrl.gateway.agents import AgentConfig, AgentEngine, load_program
from agentrl.policy import scripted
from agentrl.rollout.engine import RolloutConfig
from agentrl.types import Status
from examples.agents.calculator_agents_sdk import CHECKER, SYSTEM, calculator

PROGRAM = "examples.agents.calculator_agents_sdk:solve"
ENV = dict(parser="react", kinds=["expression"], max_ops=2)


@pytest.mark.parametrize("thought", ["", "Thought: I use the calculator.\n"])
def test_an_agents_sdk_program_with_a_sub_agent_records_exact_segments(renderer, thought):
    env = ArithmeticEnv(**ENV)
    tasks = list(env.tasks)[:4]
    solver = scripted.playing({t.data["question"]: [thought + a if i == 0 else a
                                                    for i, a in enumerate(env.gold_actions(t))] for t in tasks})

    def respond(prompt: str, turn: int) -> str:  # routed by the prompt: the checker's, or the solver's
        return "Correct" if CHECKER in prompt else solver(prompt, turn)

    policy = scripted.ScriptedPolicy(renderer, respond, renderer.generation_prompt)
    calls = []
    generate = policy.generate

    async def recording(prompt_ids, sampling):
        samples = await generate(prompt_ids, sampling)
        calls.append((tuple(prompt_ids), tuple(samples[0].token_ids)))
        return samples

    policy.generate = recording
    agent = AgentConfig(PROGRAM, tool_parser="react", timeout=60)
    engine = AgentEngine(load_program(PROGRAM), policy, renderer, RolloutConfig(group_size=2), agent)
    groups = asyncio.run(engine.run(tasks))

    sdk_tools = [Converter.tool_to_openai(calculator)]  # what the SDK sends: its schema, "strict": true
    turns = Counter()
    for task, group in zip(tasks, groups):
        sessions = {}
        for t in group.trajectories:
            assert t.status is Status.OK and t.reward == 1.0 and t.task_id == task.id, t.reason
            sessions.setdefault(t.session, []).append(t)
            ids, mask = list(t.token_ids), [0] * len(t.token_ids)
            for turn in t.turns:  # each turn sampled from exactly the ids before it; the mask 1 there only
                turns[tuple(ids[:turn.start]), tuple(ids[turn.start:turn.end])] += 1
                mask[turn.start:turn.end] = [1] * (turn.end - turn.start)
            assert list(t.loss_mask) == mask and t.prompt_len == t.turns[0].start and t.turns[-1].end == len(ids)
        assert len(sessions) == 2
        for segments in sessions.values():
            main, check = sorted(segments, key=lambda t: t.logs["segment"])
            assert [main.logs["segment"], check.logs["segment"]] == [0, 1] and "forked_from" not in check.logs
            # the solver: the env's messages under the SDK's tool schema, a calculator call, its result, the answer
            assert tuple(main.messages[:2]) == env.first_messages(task) and main.messages[0].content == SYSTEM
            assert main.token_ids[:main.prompt_len] == tuple(renderer.prompt_ids(env.first_messages(task),
                                                                                 sdk_tools))
            assert len(main.turns) == 2 and main.messages[2].tool_calls[0].name == "calculator"
            assert main.messages[2].tool_calls[0].arguments == {"expression": task.data["solution"]}
            between = renderer.decode(main.token_ids[main.turns[0].end:main.turns[1].start])
            assert task.data["answer"] in between and main.messages[3].role == "tool"
            assert renderer.decode(main.token_ids[main.turns[1].start:]).startswith(env.gold_actions(task)[1])
            # the checker: its own prompt, from scratch, on the solver's answer
            assert len(check.turns) == 1 and check.messages[0].content == CHECKER
            assert check.messages[1].content == f"Problem: {task.data['question']}\nAnswer: {task.data['answer']}"
            assert renderer.decode(check.token_ids[check.turns[0].start:]).startswith("Correct")
    assert turns == Counter(calls) and len(calls) == 4 * 2 * 3  # every call is one turn of one segment
