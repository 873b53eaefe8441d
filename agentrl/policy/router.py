"""Several engines behind one `Policy`: each episode stays on one engine, so that its prefix cache holds the
episode's history and every turn appends to it; a new episode goes to the engine with the fewest requests in
flight (ties: the one that has taken the fewest episodes).

    policy = RoutedPolicy([VLLMPolicy(...), VLLMPolicy(...)])   # e.g. one vLLM server per GPU or node

The rollout engine names each episode in `agentrl.policy.protocol.current_episode`; calls made outside an episode
are balanced the same way, without stickiness. Weight syncs go to every engine.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any, Sequence

from agentrl.policy.protocol import Policy, Sample, SamplingParams, current_episode


class RoutedPolicy:
    """A `Policy` over several engines; `max_routes` bounds how many episodes' routes it remembers (oldest dropped)."""

    def __init__(self, policies: Sequence[Policy], max_routes: int = 100_000):
        if not policies:
            raise ValueError("RoutedPolicy needs at least one engine")
        self.policies, self.max_routes = list(policies), max_routes
        self.in_flight = [0] * len(self.policies)
        self.episodes = [0] * len(self.policies)  # episodes routed to each engine
        self._routes: OrderedDict[str, int] = OrderedDict()  # episode -> engine, least recently used first

    @property
    def weight_version(self) -> int:
        """The oldest weight version among the engines."""
        return min(p.weight_version for p in self.policies)

    def route(self, episode: str | None) -> int:
        """The engine of `episode`: the one it started on, else the least busy."""
        if episode is not None and episode in self._routes:
            self._routes.move_to_end(episode)
            return self._routes[episode]
        engine = min(range(len(self.policies)), key=lambda i: (self.in_flight[i], self.episodes[i], i))
        if episode is not None:
            self._routes[episode] = engine
            self.episodes[engine] += 1
            if len(self._routes) > self.max_routes:
                self._routes.popitem(last=False)
        return engine

    def sampling_copy(self) -> RoutedPolicy:
        """The same engines' `sampling_copy`s behind a router of their own (for another process)."""
        return RoutedPolicy([p.sampling_copy() for p in self.policies], self.max_routes)

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> list[Sample]:
        """Return `sampling.n` samples continuing `prompt_ids`, from the engine of the current episode."""
        engine = self.route(current_episode.get())
        self.in_flight[engine] += 1
        try:
            return await self.policies[engine].generate(prompt_ids, sampling)
        finally:
            self.in_flight[engine] -= 1

    async def sync_weights(self, model: Any, version: int) -> None:
        """Sync every engine to `model`'s weights as `version`, one engine after the other."""
        for policy in self.policies:  # one at a time: each reads the same model's weights
            await policy.sync_weights(model, version)

    async def prepare_sync(self, model: Any, context: int = 0) -> None:
        """Each engine's start-up check that `model` can be synced into it (engines without one need none)."""
        for policy in self.policies:
            if (prepare := getattr(policy, "prepare_sync", None)) is not None:
                await prepare(model, context)

    async def release_memory(self) -> None:
        """Each engine's `release_memory` (vLLM's sleep mode), where it has one: the trainer steps next."""
        await asyncio.gather(*(release() for p in self.policies
                               if (release := getattr(p, "release_memory", None)) is not None))

    async def close(self) -> None:
        """Close every engine."""
        await asyncio.gather(*(p.close() for p in self.policies))
