"""RoutedPolicy: an episode's turns all go to the engine it started on; episodes spread over the engines."""

from __future__ import annotations

import asyncio
from collections import defaultdict

from transformers import AutoTokenizer

import agentrl
from agentrl.policy.protocol import current_episode
from agentrl.renderer import Renderer
from agentrl.rollout.engine import RolloutConfig, RolloutEngine
from agentrl.policy.router import RoutedPolicy
from agentrl.policy.scripted import ScriptedPolicy, playing


class Recording(ScriptedPolicy):
    """A scripted engine that notes which episode each request came from."""

    def __init__(self, *args, log: dict, name: str):
        super().__init__(*args)
        self.log, self.name = log, name

    async def generate(self, prompt_ids, sampling):
        self.log[current_episode.get()].append(self.name)
        await asyncio.sleep(0.001 * (hash(self.name) % 3))  # engines of different speeds
        return await super().generate(prompt_ids, sampling)


def run(policy, tasks, renderer):
    engine = RolloutEngine(lambda: agentrl.make("math/arith-v0", n_tasks=16), policy, renderer,
                           RolloutConfig(group_size=2, concurrency=8))
    try:
        return [t for g in asyncio.run(engine.run(tasks)) for t in g.trajectories]
    finally:
        engine.close()


def test_episodes_stick_to_one_engine_and_spread(tiny_model_dir):
    renderer = Renderer(AutoTokenizer.from_pretrained(tiny_model_dir))
    env = agentrl.make("math/arith-v0", n_tasks=16)
    respond = playing({t.data["question"]: env.gold_actions(t) for t in env.tasks})
    log = defaultdict(list)
    engines = [Recording(renderer, respond, "<|im_start|>assistant", log=log, name=f"e{i}") for i in range(3)]
    routed = run(RoutedPolicy(engines), list(env.tasks), renderer)
    alone = run(ScriptedPolicy(renderer, respond, "<|im_start|>assistant"), list(env.tasks), renderer)
    assert [t.token_ids for t in routed] == [t.token_ids for t in alone]
    assert len(log) == 32 and all(len(turns) == 2 for turns in log.values())  # 32 episodes of 2 turns
    assert all(len(set(turns)) == 1 for turns in log.values())  # each on one engine
    per_engine = [sum(turns[0] == f"e{i}" for turns in log.values()) for i in range(3)]
    assert min(per_engine) >= 5, per_engine  # and spread over all three
