"""Logprob parity between the sampling engine and the trainer's model, as a statistic.

Policy-gradient losses weight each sampled token by `exp(logp_trainer - logp_engine)`. If the engine
serves different weights than the trainer holds (a failed or partial weight reload: vLLM's CPU reload
of tied embeddings leaves a mixed model, 5-30 nats off on many tokens), that ratio is garbage and training
silently diverges. So after a weight sync, a few sequences are sampled from the engine and their logprobs are
recomputed with the trainer's forward pass.

The gate is a statistic, not a maximum: a bf16/fp16 engine differs from an fp32 trainer by kernel noise
(typically 1e-2 to 1 nat on the worst of 64 tokens), which the loss corrects for (`agentrl.trainers.losses`,
TIS/MIS), while a broken sync moves many tokens by several nats. A check fails when the mean |Δlogp| is above
a threshold that follows the served dtype (`mean_threshold_for`), or when more than `tail_share` of the tokens
are over `tail_nats` off; either is an error, not a warning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from pydantic import with_config

from agentrl.config import STRICT
from agentrl.policy.protocol import Policy, Sample, SamplingParams
from agentrl.policy.logprobs import is_sharded, token_logprobs
from agentrl.policy.precision import autocast

# The mean |Δlogp| (nats) a sync may show, by the served dtype: float32 engines match an fp32 trainer to ~1e-5;
# half-precision kernels (vLLM's "auto" on GPU serves fp16/bf16) differ by ~1e-2 on average.
MEAN_THRESHOLDS = {"float32": 1e-3, "float": 1e-3, "bfloat16": 5e-2, "float16": 5e-2, "half": 5e-2, "auto": 5e-2}


def mean_threshold_for(dtype: str) -> float:
    """The default mean |Δlogp| threshold (nats) for an engine serving `dtype` (vLLM's `--dtype` spelling)."""
    if dtype not in MEAN_THRESHOLDS:
        raise ValueError(f"no default parity threshold for dtype {dtype!r}; dtypes: {', '.join(MEAN_THRESHOLDS)} "
                         "(or set the threshold explicitly)")
    return MEAN_THRESHOLDS[dtype]


class ParityError(RuntimeError):
    """The engine's logprobs do not match the trainer's: the engine does not serve the trainer's weights."""


@dataclass(frozen=True)
class ParityReport:
    """The distribution of |logp_trainer - logp_engine| over the sampled tokens of one check."""

    mean_abs_diff: float  # nats
    p50_abs_diff: float
    p99_abs_diff: float
    max_abs_diff: float
    tail_share: float  # share of the tokens more than `tail_nats` off
    tail_nats: float
    mean_importance_ratio: float  # mean of exp(logp_trainer - logp_engine); 1 when they agree
    num_tokens: int
    num_sequences: int

    def __str__(self) -> str:
        return (f"|Δlogp| mean {self.mean_abs_diff:.2e}, p50 {self.p50_abs_diff:.2e}, p99 {self.p99_abs_diff:.2e}, "
                f"max {self.max_abs_diff:.2e} nats; {self.tail_share:.1%} of tokens over {self.tail_nats:g} nats; "
                f"mean ratio {self.mean_importance_ratio:.4f} over {self.num_tokens} tokens of "
                f"{self.num_sequences} sequences")


@with_config(STRICT)
@dataclass(frozen=True)
class ParityCheck:
    """When and how to check parity after a weight sync, and the gate a check must pass."""

    prompts: tuple[tuple[int, ...], ...]  # prompt token ids; one sequence is sampled from each
    every: int = 1  # check after every `every`-th sync
    mean_threshold: float = 1e-3  # max mean |Δlogp| in nats (float32; `mean_threshold_for(dtype)` for others)
    tail_nats: float = 2.0  # a token this far off is a broken sync, not kernel noise
    tail_share: float = 0.01  # max share of the tokens over `tail_nats` (a half-reloaded model: most of them)
    max_tokens: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.prompts or not all(self.prompts):
            raise ValueError("ParityCheck needs at least one non-empty prompt")
        if self.every < 1 or self.mean_threshold <= 0 or self.tail_nats <= 0 or not 0 <= self.tail_share < 1:
            raise ValueError("ParityCheck: every must be >= 1, mean_threshold and tail_nats > 0, tail_share in "
                             f"[0, 1); got {self.every}, {self.mean_threshold}, {self.tail_nats}, {self.tail_share}")

    def due(self, sync_count: int) -> bool:
        """Whether the `sync_count`-th sync gets a check."""
        return sync_count % self.every == 0

    def failures(self, report: ParityReport) -> list[str]:
        """What `report` fails of this gate (empty: it passes)."""
        out = []
        if report.mean_abs_diff > self.mean_threshold:
            out.append(f"mean |Δlogp| {report.mean_abs_diff:.2e} > {self.mean_threshold:g} nats")
        if report.tail_share > self.tail_share:
            out.append(f"{report.tail_share:.1%} of tokens over {self.tail_nats:g} nats "
                       f"(at most {self.tail_share:.1%})")
        return out


def trainer_logprobs(model: Any, prompt_ids: Sequence[int], sampled_ids: Sequence[int]) -> torch.Tensor:
    """log p(sampled[i] | prompt + sampled[:i]) as the trainer computes it (`token_logprobs`). Returns [T]."""
    return batch_trainer_logprobs(model, [(prompt_ids, sampled_ids)])[0]


def batch_trainer_logprobs(model: Any, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[torch.Tensor]:
    """`trainer_logprobs` of each (prompt ids, sampled ids), in one forward over the right-padded rows.

    A model sharded over ranks (FSDP) runs its forward on every rank at once: rank 0 first hands the sequences to
    the others, which wait for them in `follow_trainer_logprobs`."""
    sequences = [(list(prompt), list(sampled)) for prompt, sampled in sequences]
    if is_sharded(model):
        _from_rank0(sequences)
    return _forward(model, sequences)


def follow_trainer_logprobs(model: Any) -> None:
    """On the ranks after 0 of a sharded `model`: the forwards of rank 0's `batch_trainer_logprobs` (its parity
    checks during a sync), until rank 0 calls `end_trainer_logprobs`."""
    while (sequences := _from_rank0()) is not None:
        _forward(model, sequences)


def end_trainer_logprobs() -> None:
    """Rank 0 of a sharded model: release the other ranks from `follow_trainer_logprobs`."""
    _from_rank0(None)


def _from_rank0(obj: Any = None) -> Any:
    """Rank 0's `obj` on every rank (the others pass nothing)."""
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


@torch.no_grad()
def _forward(model: Any, sequences: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    rows = [prompt + sampled for prompt, sampled in sequences]
    ids_BT = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    attention_BT = torch.zeros_like(ids_BT)
    for b, row in enumerate(rows):
        ids_BT[b, :len(row)], attention_BT[b, :len(row)] = torch.tensor(row), 1
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()  # dropout off: the engine has none
    try:
        with autocast(model):  # the numerics the loss sees (mixed precision: bf16 matmuls over float32 weights)
            logp_BT, _ = token_logprobs(model, ids_BT.to(device), attention_BT.to(device))
    finally:
        model.train(was_training)
    return [logp_BT[b, len(prompt):len(prompt) + len(sampled)].float().cpu()
            for b, (prompt, sampled) in enumerate(sequences)]


def compare(model: Any, prompts: Sequence[Sequence[int]], samples: Sequence[Sample],
            tail_nats: float = 2.0) -> ParityReport:
    """Parity of the engine's `samples` (one per prompt) against `model`'s forward pass."""
    pairs = [(prompt, sample) for prompt, sample in zip(prompts, samples, strict=True) if sample.token_ids]
    if not pairs:
        raise ParityError("no sampled tokens to compare: every sample was empty")
    engine_N = torch.cat([torch.tensor(sample.logprobs, dtype=torch.float32) for _, sample in pairs])
    trainer_N = torch.cat(batch_trainer_logprobs(model, [(prompt, sample.token_ids) for prompt, sample in pairs]))
    diff_N = (trainer_N - engine_N).abs()
    p50, p99 = torch.quantile(diff_N, torch.tensor([0.5, 0.99])).tolist()
    return ParityReport(mean_abs_diff=diff_N.mean().item(), p50_abs_diff=p50, p99_abs_diff=p99,
                        max_abs_diff=diff_N.max().item(), tail_share=(diff_N > tail_nats).float().mean().item(),
                        tail_nats=tail_nats, mean_importance_ratio=(trainer_N - engine_N).exp().mean().item(),
                        num_tokens=diff_N.numel(), num_sequences=len(pairs))


async def check_parity(policy: Policy, model: Any, check: ParityCheck) -> ParityReport:
    """Sample one sequence per prompt from `policy`, compare with `model`; raise `ParityError` when the report
    fails `check`'s gate (mean |Δlogp|, or the share of tokens far off)."""
    samples = []
    for i, prompt in enumerate(check.prompts):
        sampling = SamplingParams(max_tokens=check.max_tokens, temperature=1.0, seed=check.seed + i)
        samples += await policy.generate(prompt, sampling)
    report = compare(model, check.prompts, samples, check.tail_nats)
    if failures := check.failures(report):
        raise ParityError(
            f"engine and trainer disagree: {'; '.join(failures)} ({report}). The engine is not serving the "
            "trainer's weights (failed reload, tied embeddings) or serves another dtype than the threshold assumes: "
            "check the sync, or set [engine] dtype (the threshold follows it) or [engine] parity_mean_threshold.")
    return report
