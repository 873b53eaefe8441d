"""Rewards from the policy's own confidence, without labels: RENT and self-certainty.

- `rent` (RL via entropy minimization; Prabhudesai et al. 2025): minus the mean entropy, in nats, of the
  distributions that sampled the response's tokens. Confident responses score higher.
- `self_certainty` (Kang et al. 2025; INTUITOR, Zhao et al. 2025, "Learning to Reason without External
  Rewards"): the mean over the response's tokens of KL(U || p), the distribution's divergence from uniform over
  the vocabulary, in nats: -log V - (1/V) sum_j log p_j. Unlike the entropy it is mode-seeking-blind: it grows
  with how little mass the model gives to the tokens it rules out.

Both are computed with the trainer's model, not from the sampler's logprobs: both need the whole next-token
distribution at each sampled position, and an engine returns the sampled token's logprob (and at most a few
top-k ones). The sampled token's -log p is a one-sample estimate of the entropy only, noisy per response and of
another distribution whenever sampling tempers or truncates it; self-certainty has no such estimate at all. The
cost is one forward pass without gradients over the trained episodes per step, with the LM head only on their
sampled tokens. They are scored at training time (`score_confidence`, on every rank, so that a sharded model's
forwards match), by the model as it is before the step's update.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from agentrl.policy.logprobs import HEAD_CHUNK, is_sharded, lm_head
from agentrl.policy.precision import autocast
from agentrl.trainers.batch import make_batch, token_micro_batches
from agentrl.trainers.metrics import correlation
from agentrl.types import Group, Trajectory

CONFIDENCE_SOURCES = ("rent", "self_certainty")
TOKENS_PER_PASS = 8192  # padded tokens per forward pass of the scoring


def confidence_of(logp_NV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(entropy_N, self_certainty_N) of N next-token distributions given as log-probabilities over the vocabulary:
    H = -sum_j p_j log p_j and KL(U || p) = -log V - mean_j log p_j, in nats."""
    logp_NV = logp_NV.float()
    entropy_N = -(logp_NV.exp() * logp_NV).sum(-1)
    self_certainty_N = -math.log(logp_NV.shape[-1]) - logp_NV.mean(-1)
    return entropy_N, self_certainty_N


@torch.no_grad()
def response_confidence(model: torch.nn.Module, trajectories: Sequence[Trajectory],
                        tokens_per_pass: int = TOKENS_PER_PASS) -> list[dict[str, float]]:
    """Per trajectory, the mean over its sampled tokens (loss mask 1) of the entropy and the self-certainty of the
    distribution that predicted each: `{"entropy": ..., "self_certainty": ...}` (both 0 without sampled tokens)."""
    batch = make_batch(trajectories)
    device, was_training = next(model.parameters()).device, model.training
    sums = torch.zeros(len(trajectories), 2)
    model.eval()  # dropout off, as the sampler
    try:
        for rows in token_micro_batches(torch.arange(len(batch)), batch.attention_BT.sum(-1), tokens_per_pass):
            mb = batch.select(rows).to(device)
            rows_N, targets_N = (mb.mask_BT[:, 1:] > 0).nonzero(as_tuple=True)  # hidden state t predicts token t + 1
            with autocast(model):
                if is_sharded(model):  # FSDP gathers the head's weights only inside the root's forward
                    logits_NV = model(input_ids=mb.ids_BT, attention_mask=mb.attention_BT).logits[rows_N, targets_N]
                    parts = [confidence_of(F.log_softmax(x.float(), -1)) for x in logits_NV.split(HEAD_CHUNK)]
                else:
                    hidden_NH = model.base_model(input_ids=mb.ids_BT, attention_mask=mb.attention_BT,
                                                 use_cache=False).last_hidden_state[rows_N, targets_N]
                    parts = [confidence_of(F.log_softmax(lm_head(model, h).float(), -1))
                             for h in hidden_NH.split(HEAD_CHUNK)]
            stats_N2 = torch.stack([torch.cat([p[i] for p in parts]) for i in range(2)], -1).cpu() if parts else None
            if stats_N2 is not None:
                sums.index_add_(0, rows[rows_N.cpu()], stats_N2)
    finally:
        model.train(was_training)
    counts = batch.mask_BT.sum(-1).clamp(min=1)[:, None]
    return [{"entropy": e, "self_certainty": s} for e, s in (sums / counts).tolist()]


def score_confidence(model: torch.nn.Module, groups: Sequence[Group]) -> None:
    """Scores the groups' valid trajectories that are not scored yet (their metrics `entropy` and
    `self_certainty`), with `model`."""
    todo = [t for g in groups for t in g.valid if "entropy" not in t.metrics]
    if todo:
        for t, scores in zip(todo, response_confidence(model, todo)):
            t.metrics.update(scores)


def confidence(t: Trajectory, source: str) -> float:
    """The trajectory's `rent` (minus its mean token entropy) or `self_certainty`, as `score_confidence` left it."""
    if "entropy" not in t.metrics:
        raise RuntimeError(f"the {source} reward needs the trainer's scores: call score_confidence(model, groups) "
                           "before the rewards")
    return -t.metrics["entropy"] if source == "rent" else t.metrics["self_certainty"]


def confidence_metrics(groups: Sequence[Group]) -> dict[str, float]:
    """Over the scored trajectories: their mean token entropy and self-certainty, and how each goes with the env's
    own reward (a correlation near 0 or below: confidence is not a proxy for success here)."""
    scored = [t for g in groups for t in g.valid if "entropy" in t.metrics]
    if not scored:
        return {}
    entropy = [t.metrics["entropy"] for t in scored]
    certainty = [t.metrics["self_certainty"] for t in scored]
    env = [t.reward for t in scored]
    return {"confidence/entropy": sum(entropy) / len(scored), "confidence/self_certainty": sum(certainty) / len(scored),
            "confidence/rent_env_reward_corr": correlation([-h for h in entropy], env),
            "confidence/self_certainty_env_reward_corr": correlation(certainty, env)}
