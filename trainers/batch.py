"""From trajectories to training tensors, and the trainer's own logprobs.

Everything a loss needs is derived here by pure functions: the ids are the trajectories' ids verbatim,
right-padded; `mask_BT` is their loss mask (0 on padding); `old_logp_BT` the sampler's logprobs.
Position t of `logp_BT` is log p(ids[t] | ids[:t]), so it lines up with the mask and the sampler's
logprobs token for token (position 0 is never sampled and stays 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from agentrl.types import Trajectory


@dataclass(frozen=True)
class Batch:
    ids_BT: torch.Tensor  # long, right-padded with 0
    attention_BT: torch.Tensor  # 1 on real tokens, 0 on padding
    mask_BT: torch.Tensor  # float, the loss mask: 1 exactly on sampled tokens
    old_logp_BT: torch.Tensor  # the sampler's logprobs on sampled tokens, 0 elsewhere
    adv_BT: torch.Tensor  # advantages on sampled tokens, 0 elsewhere

    def __len__(self) -> int:
        return self.ids_BT.shape[0]

    def to(self, device: torch.device | str) -> Batch:
        """The batch with every tensor moved to `device`."""
        return Batch(*(t.to(device) for t in (self.ids_BT, self.attention_BT, self.mask_BT, self.old_logp_BT,
                                               self.adv_BT)))

    def select(self, rows: torch.Tensor | slice) -> Batch:
        """A minibatch, trimmed to its longest sequence (padding costs compute)."""
        T = int(self.attention_BT[rows].sum(-1).max())
        return Batch(*(t[rows][:, :T] for t in (self.ids_BT, self.attention_BT, self.mask_BT, self.old_logp_BT,
                                                 self.adv_BT)))


def make_batch(trajectories: Sequence[Trajectory], advantages: Sequence[float | Sequence[float]]) -> Batch:
    """`advantages[i]`: one number for the whole trajectory, or one per token (e.g. from GAE / per turn)."""
    B, T = len(trajectories), max(len(t.token_ids) for t in trajectories)
    ids = torch.zeros((B, T), dtype=torch.long)
    attention = torch.zeros((B, T), dtype=torch.long)
    mask, old_logp, adv = (torch.zeros((B, T)) for _ in range(3))
    for b, (t, a) in enumerate(zip(trajectories, advantages)):
        n = len(t.token_ids)
        ids[b, :n] = torch.tensor(t.token_ids)
        attention[b, :n] = 1
        mask[b, :n] = torch.tensor(t.loss_mask, dtype=torch.float)
        old_logp[b, :n] = torch.tensor(t.logprobs)
        adv[b, :n] = torch.as_tensor(a, dtype=torch.float) * mask[b, :n]
    return Batch(ids, attention, mask, old_logp, adv)
