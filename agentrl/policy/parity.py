"""Logprob parity between the sampling engine and the trainer's model.

Policy-gradient losses weight each sampled token by `exp(logp_trainer - logp_engine)`. If the engine
serves different weights than the trainer holds (a failed or partial weight reload: vLLM's CPU reload
of tied embeddings leaves a mixed model, 5-30 nats off), that ratio is garbage and training silently
diverges. So after a weight sync, a few sequences are sampled from the engine and their logprobs are
recomputed with the trainer's forward pass; a mismatch above the threshold is an error, not a warning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from pydantic import with_config

from agentrl.config import STRICT
from agentrl.policy.protocol import Policy, Sample, SamplingParams
from agentrl.policy.logprobs import token_logprobs


class ParityError(RuntimeError):
    """The engine's logprobs do not match the trainer's: the engine does not serve the trainer's weights."""


@dataclass(frozen=True)
class ParityReport:
    max_abs_diff: float  # nats, over all sampled tokens
    mean_abs_diff: float
    mean_importance_ratio: float  # mean of exp(logp_trainer - logp_engine); 1 when they agree
    num_tokens: int
    num_sequences: int

    def __str__(self) -> str:
        return (f"max |Δlogp| {self.max_abs_diff:.2e} nats, mean {self.mean_abs_diff:.2e}, mean ratio "
                f"{self.mean_importance_ratio:.4f} over {self.num_tokens} tokens of {self.num_sequences} sequences")


@with_config(STRICT)
@dataclass(frozen=True)
class ParityCheck:
    """When and how to check parity after a weight sync."""

    prompts: tuple[tuple[int, ...], ...]  # prompt token ids; one sequence is sampled from each
    every: int = 1  # check after every `every`-th sync
    threshold: float = 1e-3  # max |logp_engine - logp_trainer| in nats (float32 engines match to ~1e-5)
    max_tokens: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.prompts or not all(self.prompts):
            raise ValueError("ParityCheck needs at least one non-empty prompt")
        if self.every < 1 or self.threshold <= 0:
            raise ValueError("every must be >= 1 and threshold > 0")

    def due(self, sync_count: int) -> bool:
        """Whether the `sync_count`-th sync gets a check."""
        return sync_count % self.every == 0


@torch.no_grad()
def trainer_logprobs(model: Any, prompt_ids: Sequence[int], sampled_ids: Sequence[int]) -> torch.Tensor:
    """log p(sampled[i] | prompt + sampled[:i]) as the trainer computes it (`token_logprobs`). Returns [T]."""
    device = next(model.parameters()).device
    ids_BT = torch.tensor([[*prompt_ids, *sampled_ids]], device=device)
    was_training = model.training
    model.eval()  # dropout off: the engine has none
    try:
        logp_BT, _ = token_logprobs(model, ids_BT, torch.ones_like(ids_BT))
    finally:
        model.train(was_training)
    return logp_BT[0, len(prompt_ids):].float().cpu()


def compare(model: Any, prompts: Sequence[Sequence[int]], samples: Sequence[Sample]) -> ParityReport:
    """Parity of the engine's `samples` (one per prompt) against `model`'s forward pass."""
    engine, trainer = [], []
    for prompt, sample in zip(prompts, samples, strict=True):
        if sample.token_ids:
            engine.append(torch.tensor(sample.logprobs, dtype=torch.float32))
            trainer.append(trainer_logprobs(model, prompt, sample.token_ids))
    if not engine:
        raise ParityError("no sampled tokens to compare: every sample was empty")
    engine_N, trainer_N = torch.cat(engine), torch.cat(trainer)
    diff_N = (trainer_N - engine_N).abs()
    return ParityReport(diff_N.max().item(), diff_N.mean().item(), (trainer_N - engine_N).exp().mean().item(),
                        diff_N.numel(), len(engine))


async def check_parity(policy: Policy, model: Any, check: ParityCheck) -> ParityReport:
    """Sample one sequence per prompt from `policy`, compare with `model`; raise `ParityError` above threshold."""
    samples = []
    for i, prompt in enumerate(check.prompts):
        sampling = SamplingParams(max_tokens=check.max_tokens, temperature=1.0, seed=check.seed + i)
        samples += await policy.generate(prompt, sampling)
    report = compare(model, check.prompts, samples)
    if report.max_abs_diff > check.threshold:
        raise ParityError(f"engine and trainer disagree: {report} (threshold {check.threshold:g} nats). The engine "
                          "is not serving the trainer's weights (failed reload, tied embeddings, dtype mismatch).")
    return report
