"""Supervised fine-tuning on trajectories, with the same loss mask as RL: only sampled (assistant) tokens
are trained on. With a filter it is rejection-sampling distillation: keep the trajectories that pass
(e.g. outcome reward 1) and imitate them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch
from pydantic import with_config

from agentrl.config import STRICT
from agentrl.types import Status, Trajectory
from agentrl.trainers.batch import make_batch, token_micro_batches
from agentrl.trainers.supervised import fit, shuffled
from agentrl.policy.logprobs import token_logprobs
from agentrl.policy.precision import autocast


@with_config(STRICT)
@dataclass(frozen=True)
class SFTConfig:
    epochs: int = 2
    lr: float = 1e-3
    batch_size: int = 16  # trajectories per optimizer step
    # Padded tokens per forward/backward pass (gradient accumulation, rows sorted by length); unset: the whole batch
    # at once, whose activations grow with batch_size x the longest trajectory (SmolLM2-135M's search SFT, 16 episodes
    # of ~500 tokens in float32, passed 20 GiB and was killed)
    micro_batch_tokens: int | None = None
    max_grad_norm: float = 1.0
    min_outcome: float | None = None  # rejection sampling: keep trajectories whose outcome is at least this
    # Train on each trajectory's last turn only: the final answer given everything before it (reading, not acting).
    last_turn_only: bool = False
    seed: int = 0

    def __post_init__(self):
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ValueError(f"sft.config.micro_batch_tokens must be >= 1 (or unset: the whole batch at once), "
                             f"got {self.micro_batch_tokens}")


def kept_for_sft(t: Trajectory, min_outcome: float | None) -> bool:
    """The SFT filter: `t` is not an error, and its outcome (else its reward) is at least `min_outcome`, if set."""
    if t.status is Status.ERROR:
        return False
    return min_outcome is None or t.reward_components.get("outcome", t.reward) >= min_outcome


def last_turn_only(t: Trajectory) -> Trajectory:
    """`t` with its loss mask cut to the last assistant turn."""
    last = t.turns[-1]
    mask = tuple(m if last.start <= i < last.end else 0 for i, m in enumerate(t.loss_mask))
    return replace(t, loss_mask=mask)


def sft(model: torch.nn.Module, trajectories: Sequence[Trajectory], cfg: SFTConfig,
        on_step: Callable[[dict], None] | None = None) -> list[dict]:
    """Trains `model` in place on the masked tokens of the trajectories that pass the filter."""
    kept = [t for t in trajectories if kept_for_sft(t, cfg.min_outcome)]
    if not kept:
        raise ValueError(f"No trajectory passes the SFT filter (min_outcome={cfg.min_outcome}).")
    if cfg.last_turn_only:
        kept = [last_turn_only(t) for t in kept]
    batch = make_batch(kept)
    device = next(model.parameters()).device

    def micro_batches(rows: torch.Tensor) -> list[torch.Tensor]:
        if cfg.micro_batch_tokens is None:
            return [rows]
        return token_micro_batches(rows, batch.attention_BT[rows].sum(-1), cfg.micro_batch_tokens)

    steps = ([(epoch, batch.select(micro).to(device), batch.mask_BT[rows].sum()) for micro in micro_batches(rows)]
             for epoch, rows in shuffled(len(batch), cfg.batch_size, cfg.epochs, cfg.seed))

    def loss_of(micro_batch):
        epoch, mb, step_tokens = micro_batch
        with autocast(model):  # the compute dtype, over float32 master weights (if marked)
            logp_BT, _ = token_logprobs(model, mb.ids_BT, mb.attention_BT, mask_BT=mb.mask_BT)
        loss = -(logp_BT * mb.mask_BT).sum() / step_tokens  # its share of the step's token-mean NLL
        return loss, {"epoch": epoch, "kept": len(kept)}

    return fit(model, steps, loss_of, lr=cfg.lr, name="SFT", max_grad_norm=cfg.max_grad_norm, on_step=on_step)
