"""Logprob parity between the sampling engine and the trainer's model, as a statistic.

Policy-gradient losses weight each sampled token by `exp(logp_trainer - logp_engine)`. If the engine
serves different weights than the trainer holds (a failed or partial weight reload: vLLM's CPU reload
of tied embeddings leaves a mixed model, 5-30 nats off on many tokens; or a sync that never happened), that
ratio is garbage and training silently diverges. So after a weight sync, the engine samples a few sequences
and scores them, and the trainer's forward pass scores the same tokens.

What is compared. The sampled tokens alone cannot see a missed sync once the policy is confident: every sampled
token then has logprob ~0 under any nearby weights. So the engine also reports the tokens it did not choose, where
nearby weights do differ: the prompt's own tokens (vLLM's prompt logprobs), a fixed probe text (`PROBE_TEXT`,
scored as a prompt), and its top-k alternatives at every position. Each kind is gated on its own mean |Δlogp|.

The gate is a statistic, not a maximum: a bf16/fp16 engine differs from an fp32 trainer by kernel noise, which the
loss corrects for (`agentrl.trainers.losses`, TIS/MIS), while a broken sync moves many tokens by several nats. A
check fails when a kind's mean |Δlogp| is above its threshold, which follows the served dtype
(`mean_thresholds_for`), or when more than `tail_share` of all compared tokens are over `tail_nats` off; either is
an error, not a warning.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch
from pydantic import with_config

from agentrl.config import STRICT
from agentrl.policy.protocol import SamplingParams
from agentrl.policy.logprobs import is_sharded
from agentrl.policy.precision import autocast

# The mean |Δlogp| (nats) a sync may show, by the served dtype: on the sampled tokens, and on the tokens the engine
# did not sample (prompt, probe, top-k). float32 engines match an fp32 trainer to ~1e-5 on every kind. Half precision
# (vLLM's "auto" on GPU serves fp16/bf16) rounds logits of magnitude 20-40 to 0.1-0.25: measured on SmolLM2-135M,
# bf16 against fp32 differs by a mean of 0.014-0.023 nats on its own greedy tokens (near-certain: the rounding
# cancels in the softmax), 0.07 on prompt tokens and 0.07-0.09 on the top-5 alternatives.
MEAN_THRESHOLDS = {"float32": (1e-3, 1e-3), "float": (1e-3, 1e-3), "bfloat16": (5e-2, 0.25),
                   "float16": (5e-2, 0.25), "half": (5e-2, 0.25), "auto": (5e-2, 0.25)}
# Text the check scores as a prompt after every sync: prose, numbers, code and markup, where every token has room
# to move (a confident policy's own outputs do not).
PROBE_TEXT = ("The committee met on 14 March 1987 in Lisbon to discuss the budget. Revenue rose 3.2% to $41.7 "
              "million, while costs fell. def area(r):\n    return 3.14159 * r ** 2\n<table><tr><td>alpha</td>"
              "<td>beta</td></tr></table> Quick brown foxes jump over lazy dogs; zebras quietly graze nearby.")
KINDS = ("sampled", "prompt", "probe", "top-k")


def mean_thresholds_for(dtype: str) -> tuple[float, float]:
    """The default mean |Δlogp| thresholds (nats) for an engine serving `dtype` (vLLM's `--dtype` spelling): on
    the sampled tokens, and on the tokens it did not sample."""
    if dtype not in MEAN_THRESHOLDS:
        raise ValueError(f"no default parity threshold for dtype {dtype!r}; dtypes: {', '.join(MEAN_THRESHOLDS)} "
                         "(or set the threshold explicitly)")
    return MEAN_THRESHOLDS[dtype]


class ParityError(RuntimeError):
    """The engine's logprobs do not match the trainer's: the engine does not serve the trainer's weights."""


@dataclass(frozen=True)
class Probe:
    """One sequence as an engine scored it for a parity check: a prompt and what the engine sampled after it, the
    engine's logprob of every token after the first, and its top alternatives at each of those positions."""

    token_ids: tuple[int, ...]  # the prompt, then the sampled tokens
    num_prompt: int
    logprobs: tuple[float, ...]  # [i]: log p(token_ids[i + 1] | token_ids[:i + 1])
    top: tuple[dict[int, float], ...]  # [i]: the engine's most likely tokens at that position, with their logprobs

    def __post_init__(self) -> None:
        if not len(self.logprobs) == len(self.top) == len(self.token_ids) - 1 or not 0 < self.num_prompt:
            raise ValueError(f"a Probe of {len(self.token_ids)} tokens ({self.num_prompt} of prompt) needs "
                             f"{len(self.token_ids) - 1} logprobs and top entries, got {len(self.logprobs)} and "
                             f"{len(self.top)}")


class Probing(Protocol):
    """An engine that can be parity-checked: it samples a continuation and scores the whole sequence."""

    async def probe(self, prompt_ids: Sequence[int], sampling: SamplingParams, top_k: int) -> Probe:
        """Sample one continuation of `prompt_ids`; its `Probe`, with the `top_k` most likely tokens per position."""
        ...


@dataclass(frozen=True)
class ParityReport:
    """The distribution of |logp_trainer - logp_engine| over the compared tokens of one check, and each kind's
    count and mean (`KINDS`: sampled, prompt, probe, top-k)."""

    mean_abs_diff: float  # nats, over every compared token
    p50_abs_diff: float
    p99_abs_diff: float
    max_abs_diff: float
    tail_share: float  # share of the tokens more than `tail_nats` off
    tail_nats: float
    mean_importance_ratio: float  # mean of exp(logp_trainer - logp_engine) over the sampled tokens; 1 when they agree
    num_tokens: int
    num_sequences: int
    kinds: dict[str, tuple[int, float]] = field(default_factory=dict)  # kind -> (tokens, mean |Δlogp|)

    def __str__(self) -> str:
        kinds = ", ".join(f"{n} {kind} (mean {mean:.1e})" for kind, (n, mean) in self.kinds.items())
        return (f"|Δlogp| mean {self.mean_abs_diff:.2e}, p50 {self.p50_abs_diff:.2e}, p99 {self.p99_abs_diff:.2e}, "
                f"max {self.max_abs_diff:.2e} nats; {self.tail_share:.1%} of tokens over {self.tail_nats:g} nats; "
                f"mean ratio {self.mean_importance_ratio:.4f}; over {self.num_tokens} tokens of "
                f"{self.num_sequences} sequences: {kinds}")


@with_config(STRICT)
@dataclass(frozen=True)
class ParityCheck:
    """When and how to check parity after a weight sync, and the gate a check must pass."""

    prompts: tuple[tuple[int, ...], ...]  # prompt token ids; one sequence is sampled from each
    probe: tuple[int, ...] = ()  # a fixed text's token ids (`PROBE_TEXT`), scored as a prompt
    every: int = 1  # check after every `every`-th sync
    mean_threshold: float = 1e-3  # max mean |Δlogp| (nats) of the sampled tokens (`mean_thresholds_for(dtype)`)
    unsampled_mean_threshold: float = 1e-3  # and of each kind the engine did not sample: prompt, probe, top-k
    tail_nats: float = 2.0  # a token this far off is a broken sync, not kernel noise
    tail_share: float = 0.01  # max share of the tokens over `tail_nats` (a half-reloaded model: most of them)
    max_tokens: int = 32
    top_k: int = 5  # alternatives compared at each position (vLLM allows up to its --max-logprobs, 20)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.prompts or not all(self.prompts):
            raise ValueError("ParityCheck needs at least one non-empty prompt")
        if (self.every < 1 or min(self.mean_threshold, self.unsampled_mean_threshold, self.tail_nats) <= 0
                or not 0 <= self.tail_share < 1 or not 0 <= self.top_k <= 20):
            raise ValueError("ParityCheck: every must be >= 1, the mean thresholds and tail_nats > 0, tail_share in "
                             f"[0, 1), top_k in [0, 20]; got {self.every}, {self.mean_threshold}, "
                             f"{self.unsampled_mean_threshold}, {self.tail_nats}, {self.tail_share}, {self.top_k}")

    def due(self, sync_count: int) -> bool:
        """Whether the `sync_count`-th sync gets a check."""
        return sync_count % self.every == 0

    def failures(self, report: ParityReport) -> list[str]:
        """What `report` fails of this gate (empty: it passes)."""
        out = []
        for kind, (n, mean) in report.kinds.items():
            threshold = self.mean_threshold if kind == "sampled" else self.unsampled_mean_threshold
            if n and mean > threshold:
                out.append(f"{kind} tokens' mean |Δlogp| {mean:.2e} > {threshold:g} nats")
        if report.tail_share > self.tail_share:
            out.append(f"{report.tail_share:.1%} of tokens over {self.tail_nats:g} nats "
                       f"(at most {self.tail_share:.1%})")
        return out


Query = tuple[int, int]  # (position i, token): log p(token | ids[:i + 1])


def trainer_logprobs(model: Any, prompt_ids: Sequence[int], sampled_ids: Sequence[int]) -> torch.Tensor:
    """log p(sampled[i] | prompt + sampled[:i]) as the trainer computes it. Returns [T]."""
    P = len(prompt_ids)
    queries = [(P - 1 + i, t) for i, t in enumerate(sampled_ids)]
    return trainer_scores(model, [([*prompt_ids, *sampled_ids], queries)])[0]


def trainer_scores(model: Any, rows: Sequence[tuple[Sequence[int], Sequence[Query]]]) -> list[torch.Tensor]:
    """For each row (token ids, queries), the trainer's logprob of each query, in one forward over the
    right-padded rows.

    A model sharded over ranks (FSDP) runs its forward on every rank at once: rank 0 first hands the rows to the
    others, which wait for them in `follow_trainer_logprobs`."""
    rows = [(list(ids), list(queries)) for ids, queries in rows]
    if is_sharded(model):
        _from_rank0(rows)
    return _forward(model, rows)


def follow_trainer_logprobs(model: Any) -> None:
    """On the ranks after 0 of a sharded `model`: the forwards of rank 0's `trainer_scores` (its parity checks
    during a sync), until rank 0 calls `end_trainer_logprobs`."""
    while (rows := _from_rank0()) is not None:
        _forward(model, rows)


def end_trainer_logprobs() -> None:
    """Rank 0 of a sharded model: release the other ranks from `follow_trainer_logprobs`."""
    _from_rank0(None)


def _from_rank0(obj: Any = None) -> Any:
    """Rank 0's `obj` on every rank (the others pass nothing)."""
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


@torch.no_grad()
def _forward(model: Any, rows: list[tuple[list[int], list[Query]]]) -> list[torch.Tensor]:
    ids_BT = torch.zeros(len(rows), max(len(ids) for ids, _ in rows), dtype=torch.long)
    attention_BT = torch.zeros_like(ids_BT)
    for b, (ids, _) in enumerate(rows):
        ids_BT[b, :len(ids)], attention_BT[b, :len(ids)] = torch.tensor(ids), 1
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()  # dropout off: the engine has none
    try:
        with autocast(model):  # the numerics the loss sees (mixed precision: bf16 matmuls over float32 weights)
            logits_BTV = model(input_ids=ids_BT.to(device), attention_mask=attention_BT.to(device)).logits
        out = []
        for b, (_, queries) in enumerate(rows):
            positions, tokens = (torch.tensor([q[k] for q in queries], dtype=torch.long, device=device) for k in (0, 1))
            logp_NV = logits_BTV[b, positions].float().log_softmax(-1)  # as the loss computes it: float32
            out.append(logp_NV.gather(1, tokens[:, None]).squeeze(1).cpu())
    finally:
        model.train(was_training)
    return out


def compare(model: Any, probes: Sequence[Probe], tail_nats: float = 2.0, probe_text: Probe | None = None
            ) -> ParityReport:
    """Parity of the engine's `probes` (and its scoring of the probe text) against `model`'s forward pass: every
    token after the first of each, by kind (`KINDS`; the token sampled after the probe text is a probe token: no
    task's), and the engine's alternatives at every position."""
    rows, engine, kinds = [], [], []
    for probe, prompt_kind in [*((p, "prompt") for p in probes), *([(probe_text, "probe")] if probe_text else [])]:
        queries = []
        for i, (token, logprob, top) in enumerate(zip(probe.token_ids[1:], probe.logprobs, probe.top)):
            queries.append((i, token))
            engine.append(logprob)
            kinds.append("sampled" if i + 1 >= probe.num_prompt and prompt_kind == "prompt" else prompt_kind)
            for alternative, alternative_logprob in top.items():
                if alternative != token:
                    queries.append((i, alternative))
                    engine.append(alternative_logprob)
                    kinds.append("top-k")
        rows.append((probe.token_ids, queries))
    if "sampled" not in kinds:
        raise ParityError("no sampled tokens to compare: every sample was empty")
    trainer_N, engine_N = torch.cat(trainer_scores(model, rows)), torch.tensor(engine, dtype=torch.float32)
    diff_N = (trainer_N - engine_N).abs()
    by_kind = {kind: torch.tensor([k == kind for k in kinds]) for kind in KINDS}
    sampled_N = by_kind["sampled"]
    p50, p99 = torch.quantile(diff_N, torch.tensor([0.5, 0.99])).tolist()
    return ParityReport(mean_abs_diff=diff_N.mean().item(), p50_abs_diff=p50, p99_abs_diff=p99,
                        max_abs_diff=diff_N.max().item(), tail_share=(diff_N > tail_nats).float().mean().item(),
                        tail_nats=tail_nats,
                        mean_importance_ratio=(trainer_N - engine_N)[sampled_N].exp().mean().item(),
                        num_tokens=diff_N.numel(), num_sequences=len(rows),
                        kinds={kind: (int(m.sum()), diff_N[m].mean().item()) for kind, m in by_kind.items() if m.any()})


async def check_parity(policy: Probing, model: Any, check: ParityCheck) -> ParityReport:
    """Sample one sequence per prompt from `policy` and score it there, with the probe text; compare with `model`;
    raise `ParityError` when the report fails `check`'s gate (a kind's mean |Δlogp|, or the share of tokens far
    off)."""
    def sampling(i: int, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=check.seed + i)

    probes = await asyncio.gather(*(policy.probe(prompt, sampling(i, check.max_tokens), check.top_k)
                                    for i, prompt in enumerate(check.prompts)))
    probe_text = await policy.probe(check.probe, sampling(0, 1), check.top_k) if check.probe else None
    report = compare(model, probes, check.tail_nats, probe_text)
    if failures := check.failures(report):
        raise ParityError(
            f"engine and trainer disagree: {'; '.join(failures)} ({report}). The engine is not serving the "
            "trainer's weights (a missed or failed reload, tied embeddings) or serves another dtype than the "
            "thresholds assume: check the sync, or set [engine] dtype (the thresholds follow it) or [engine] "
            "parity_mean_threshold / parity_unsampled_mean_threshold.")
    return report
