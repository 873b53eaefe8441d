"""Tandem rollouts: a trainable senior and a frozen junior write each response together.

At every handoff boundary (after each token, word or sentence) a coin with probability `p_junior` picks
who writes the next unit. The team gets the env's usual reward; GRPO then trains the senior on its own
tokens only: the junior's tokens keep loss mask 0, exactly like observations, while every token id stays
as sampled. What this rewards is reasoning that a weaker partner can pick up mid-way.

`TandemPolicy` is a `Policy`, so the rollout engine, GRPO and evaluation use it unchanged. Both partners
are `Policy`s too: two in-process models, or two vLLM servers (e.g. the senior's initial weights).

How a unit ends, per writer request of up to `lookahead` tokens:
- token: after one token;
- word: before the next token that starts with whitespace (that token and the rest of the request are
  dropped unsampled, and the next writer samples afresh);
- sentence: after the first token holding `.`, `!`, `?` or a newline.
Dropping the tokens after a boundary is the same as never sampling them, so every kept token is an
ordinary sample of its writer, and its logprob is that writer's.

Evaluation adds handoff robustness (success when the junior writes each unit with probability p, or takes
over after the senior's first k units of each turn) and the junior's cross-entropy on the senior's solo
tokens: how readable the senior's reasoning is to the junior.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Literal, Sequence

import torch
from pydantic import with_config

from agentrl.config import STRICT
from agentrl.policy.protocol import Policy, Sample, SamplingParams
from agentrl.types import Trajectory
from agentrl.trainers.batch import make_batch
from agentrl.policy.logprobs import token_logprobs

Unit = Literal["token", "word", "sentence"]
SENTENCE_END = frozenset(".!?\n")


@with_config(STRICT)
@dataclass(frozen=True)
class TandemConfig:
    p_junior: float = 0.5  # probability that the junior writes a unit, during training
    unit: Unit = "word"
    junior: str | None = None  # the junior's model dir; None: the senior's weights when RL starts, frozen
    lookahead: int = 8  # tokens per writer request; the ones past a unit's end are dropped
    eval_p: tuple[float, ...] = (0.25, 0.5)  # handoff robustness: junior writes each unit with probability p
    eval_after: tuple[int, ...] = (2, 8)  # ...and: junior takes over after the senior's first k units

    def __post_init__(self) -> None:
        for p in (self.p_junior, *self.eval_p):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"junior probabilities must be in [0, 1], got {p}")
        if self.lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, got {self.lookahead}")


def unit_end(texts: Sequence[str], unit: Unit, unit_len: int) -> int | None:
    """How many of these tokens (their decoded `texts`) finish the current unit, which already holds
    `unit_len` tokens; None when the unit goes on past them."""
    for i, text in enumerate(texts):
        if unit == "token":
            return 1
        if unit == "word" and unit_len + i > 0 and text[:1].isspace():
            return i
        if unit == "sentence" and SENTENCE_END & set(text):
            return i + 1
    return None


class TandemPolicy:
    """A `Policy` whose samples the senior and the junior write unit by unit. `Sample.trainable` marks the
    senior's tokens. Weight syncs go to the senior; the junior stays frozen.

    Who writes unit u of a response: the junior if u >= `junior_after` (a takeover), else with probability
    `p_junior` (a seeded coin, so a seeded request is reproducible)."""

    def __init__(self, senior: Policy, junior: Policy, tokenizer: Any, unit: Unit = "word", p_junior: float = 0.5,
                 junior_after: int | None = None, lookahead: int = 8):
        self.senior, self.junior, self.unit = senior, junior, unit
        self.p_junior, self.junior_after, self.lookahead = p_junior, junior_after, lookahead
        self._text = lru_cache(maxsize=None)(lambda i: tokenizer.decode([i]))

    @property
    def weight_version(self) -> int:
        """The senior's weight version."""
        return self.senior.weight_version

    def _junior_writes(self, unit_index: int, coin: random.Random) -> bool:
        if self.junior_after is not None and unit_index >= self.junior_after:
            return True
        return coin.random() < self.p_junior

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> list[Sample]:
        """Return `sampling.n` samples continuing `prompt_ids`, each unit written by the senior or the junior."""
        base = sampling.seed if sampling.seed is not None else random.getrandbits(62)
        return list(await asyncio.gather(*(self._one(list(prompt_ids), sampling, base + k)
                                           for k in range(sampling.n))))

    async def _one(self, prompt: list[int], sampling: SamplingParams, seed: int) -> Sample:
        coin = random.Random(seed)
        ids, logprobs, trainable = [], [], []
        unit_index, unit_len, calls = 0, 0, 0
        junior = self._junior_writes(0, coin)
        while len(ids) < sampling.max_tokens:
            request = replace(sampling, n=1, seed=seed * 1_000_003 + calls,
                              max_tokens=min(self.lookahead, sampling.max_tokens - len(ids)))
            calls += 1
            sample = (await (self.junior if junior else self.senior).generate(prompt + ids, request))[0]
            cut = unit_end([self._text(t) for t in sample.token_ids], self.unit, unit_len)
            keep = len(sample.token_ids) if cut is None else cut
            ids += sample.token_ids[:keep]
            logprobs += sample.logprobs[:keep]
            trainable += [int(not junior)] * keep
            if sample.finish_reason == "stop" and keep == len(sample.token_ids):  # the stop token was kept
                return Sample(tuple(ids), tuple(logprobs), "stop", tuple(trainable))
            if cut is None:  # the unit goes on with the same writer
                unit_len += keep
                continue
            unit_index, unit_len = unit_index + 1, 0
            junior = self._junior_writes(unit_index, coin)
        return Sample(tuple(ids), tuple(logprobs), "length", tuple(trainable))

    async def sync_weights(self, model: Any, version: int) -> None:
        """Sync the senior to `model`'s weights as `version`; the junior stays frozen."""
        await self.senior.sync_weights(model, version)

    async def close(self) -> None:
        """Close the senior and the junior."""
        await self.senior.close()
        await self.junior.close()


@torch.no_grad()
def junior_cross_entropy(junior: torch.nn.Module, trajectories: Sequence[Trajectory], batch_size: int = 16) -> float:
    """Mean per-token cross-entropy (nats) of the junior model on the tokens the senior sampled: low means
    the senior's text is predictable, i.e. readable, to the junior."""
    total, count = 0.0, 0
    device = next(junior.parameters()).device
    for start in range(0, len(trajectories), batch_size):
        chunk = [t for t in trajectories[start:start + batch_size] if t.num_sampled]
        if not chunk:
            continue
        batch = make_batch(chunk, [0.0] * len(chunk)).to(device)
        logp_BT, _ = token_logprobs(junior, batch.ids_BT, batch.attention_BT, mask_BT=batch.mask_BT)
        total -= float((logp_BT * batch.mask_BT).sum())
        count += int(batch.mask_BT.sum())
    return total / count if count else float("nan")
