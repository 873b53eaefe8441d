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
import copy
import os
import random
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

import torch
from pydantic import with_config
from transformers import AutoModelForCausalLM

from agentrl.config import STRICT
from agentrl.env.suites import Suite, SuiteEntry
from agentrl.eval.run import run_suite
from agentrl.policy.backends import open_policy
from agentrl.policy.hf import HFPolicy
from agentrl.policy.logprobs import token_logprobs
from agentrl.policy.protocol import Policy, Sample, SamplingParams
from agentrl.renderer import Renderer
from agentrl.rollout import seeds
from agentrl.trainers.batch import make_batch
from agentrl.trainers.checkpoint import save_model
from agentrl.trainers.methods.grpo import train as grpo_train
from agentrl.trainers.methods.stage import RLStage, Setup, run_loop
from agentrl.types import Trajectory

if TYPE_CHECKING:
    from agentrl.trainers.job.recipe import TrainJob

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
            request = replace(sampling, n=1, seed=seeds.turn_seed(seed, calls),
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
        batch = make_batch(chunk).to(device)
        logp_BT, _ = token_logprobs(junior, batch.ids_BT, batch.attention_BT, mask_BT=batch.mask_BT)
        total -= float((logp_BT * batch.mask_BT).sum())
        count += int(batch.mask_BT.sum())
    return total / count if count else float("nan")


class Handoff:
    """Tandem's partner and its evaluation: the frozen junior (a policy, and an in-process copy for its
    cross-entropy), the training policy, and handoff robustness on the held-out split."""

    def __init__(self, job: TrainJob, senior: Policy, tokenizer: Any, model: torch.nn.Module):
        self.cfg, self.senior, self.tokenizer, self.job = job.tandem, senior, tokenizer, job
        if job.tandem.junior is None:  # the senior's weights as RL starts (after any SFT), frozen
            self.junior_model = copy.deepcopy(model).eval().requires_grad_(False)
            if job.engine.kind == "transformers":
                self.junior = HFPolicy(self.junior_model, tokenizer)
            else:
                junior_dir = Path(os.path.expanduser(job.out_dir)) / "junior"
                save_model(self.junior_model, tokenizer, junior_dir)
                self.junior = open_policy(str(junior_dir), job.engine)
        else:
            self.junior = open_policy(job.tandem.junior, job.engine)
            self.junior_model = AutoModelForCausalLM.from_pretrained(os.path.expanduser(job.tandem.junior)).eval()

    def policy(self, **schedule: Any) -> TandemPolicy:
        """A `TandemPolicy` of the senior and the junior with this `schedule` (`p_junior`, `junior_after`)."""
        return TandemPolicy(self.senior, self.junior, self.tokenizer, self.cfg.unit,
                            lookahead=self.cfg.lookahead, **schedule)

    def training_policy(self) -> TandemPolicy:
        """The tandem policy that RL samples from: the junior writes each unit with probability `tandem.p_junior`."""
        return self.policy(p_junior=self.cfg.p_junior)

    def evaluate(self, solo: list[Trajectory], renderer: Renderer, label: str, log: Callable[[str], None]
                 ) -> dict[str, Any]:
        """Success with the junior writing each unit with probability p / taking over after k units, and the
        junior's cross-entropy on the senior's solo held-out tokens; each schedule's episodes in
        OUT/heldout/LABEL/handoff/SCHEDULE."""
        out: dict[str, Any] = {"junior_xent": junior_cross_entropy(self.junior_model, solo)}
        schedules = [(f"p={p}", {"p_junior": p}) for p in self.cfg.eval_p] + \
                    [(f"after={k}", {"p_junior": 0.0, "junior_after": k}) for k in self.cfg.eval_after]
        job = self.job
        split = job.eval.split if isinstance(job.eval.split, str) else job.eval.split[0]
        suite = Suite(f"{job.env} handoff", entries=(SuiteEntry(job.env, split, job.eval.n, job.env_kwargs),))
        for name, schedule in schedules:
            results = run_suite(suite, self.policy(**schedule), renderer,
                                Path(os.path.expanduser(job.out_dir)) / "heldout" / label.replace(" ", "_")
                                / "handoff" / name, job.model, config=replace(job.eval.rollout, group_size=1))
            out[name] = results["all"]["success"]["rate"]
        log(f"handoff robustness ({split}): " + ", ".join(f"{k} {v:.3f}" for k, v in out.items()))
        return out


class TandemStage(RLStage):
    """`[tandem]`: GRPO on tandem rollouts, and handoff robustness in every held-out evaluation."""

    def __init__(self, setup: Setup):
        super().__init__(setup)
        self.handoff = Handoff(setup.job, setup.policy, setup.tokenizer, setup.model)

    @staticmethod
    def check(job: TrainJob) -> None:
        if job.engine.url:
            raise ValueError("[tandem] starts a second vLLM server for the junior; it cannot attach to engine.url: "
                             "remove engine.url to let the job start both servers")

    def train(self) -> dict[str, Any]:
        cfg = self.setup.job.tandem
        run_loop(self.setup, self.setup.job.grpo, grpo_train, "GRPO", self.handoff.training_policy(),
                 f" (tandem: junior writes each {cfg.unit} with p={cfg.p_junior})")
        return {}

    def heldout(self, trajectories: list[Trajectory], label: str) -> dict[str, Any]:
        return {"handoff": self.handoff.evaluate(trajectories, self.setup.renderer, label, self.setup.log)}

    def close(self) -> None:
        asyncio.run(self.handoff.junior.close())
