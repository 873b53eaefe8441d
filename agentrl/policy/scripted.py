"""A policy that plays written demonstrations instead of sampling from a model.

It serves two jobs: expert demonstrations for SFT warm starts (with the same exact-token trajectories
as model rollouts), and deterministic policies for testing environments and the engine. Its logprobs
are 0.0: they come from no model, so its trajectories are for supervised training only.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Sequence

from agentrl.policy.protocol import Sample, SamplingParams
from agentrl.renderer import Renderer


class ScriptedPolicy:
    """`respond(prompt_text, turn) -> text`: the next assistant text, given the decoded prompt and how many
    assistant turns it already holds. The text is emitted as its canonical token ids plus the turn end."""

    weight_version = 0

    def __init__(self, renderer: Renderer, respond: Callable[[str, int], str], turn_marker: str):
        self.renderer, self.respond, self.turn_marker = renderer, respond, turn_marker

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> list[Sample]:
        """`sampling.n` copies of the scripted next turn, cut to `sampling.max_tokens` (then finishing "length")."""
        await asyncio.sleep(0)  # let concurrent episodes interleave, as a real engine would
        prompt = self.renderer.decode(prompt_ids)
        turn = prompt.count(self.turn_marker) - 1  # the generation prompt opens one more turn
        ids = tuple(self.renderer.encode(self.respond(prompt, turn)) + [self.renderer.stop_token_ids[0]])
        finish = "length" if len(ids) > sampling.max_tokens else "stop"
        ids = ids[:sampling.max_tokens]
        return [Sample(ids, (0.0,) * len(ids), finish)] * sampling.n

    async def sync_weights(self, model: Any, version: int) -> None:
        """Always raises `TypeError`: a scripted policy has no weights."""
        raise TypeError("A ScriptedPolicy has no weights to sync.")

    async def close(self) -> None:
        """Nothing to release."""
        pass


def playing(scripts: dict[str, Sequence[str]]) -> Callable[[str, int], str]:
    """A `respond` that finds the script whose key (e.g. the task's question) is in the prompt and plays
    its turn-th text."""

    def respond(prompt: str, turn: int) -> str:
        matches = [key for key in scripts if key in prompt]
        if not matches:
            raise KeyError("No script matches this prompt")
        texts = scripts[max(matches, key=len)]  # the longest: one question may contain a shorter one
        return texts[min(turn, len(texts) - 1)]

    return respond
