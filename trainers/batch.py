"""From trajectories to training tensors, and the trainer's own logprobs.

Everything a loss needs is derived here by pure functions: the ids are the trajectories' ids verbatim,
right-padded; `mask_BT` is their loss mask (0 on padding); `old_logp_BT` the sampler's logprobs.
Position t of `logp_BT` is log p(ids[t] | ids[:t]), so it lines up with the mask and the sampler's
logprobs token for token (position 0 is never sampled and stays 0).

`token_micro_batches` cuts a minibatch into micro-batches by a token budget rather than a number of rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil
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


def make_batch(trajectories: Sequence[Trajectory], advantages: Sequence[float | Sequence[float]] | None = None
               ) -> Batch:
    """`advantages[i]`: one number for the whole trajectory, or one per token (e.g. from GAE / per turn); None: 0
    everywhere (a batch for logprobs or supervised training, which no advantage weighs)."""
    B, T = len(trajectories), max(len(t.token_ids) for t in trajectories)
    ids = torch.zeros((B, T), dtype=torch.long)
    attention = torch.zeros((B, T), dtype=torch.long)
    mask, old_logp, adv = (torch.zeros((B, T)) for _ in range(3))
    for b, (t, a) in enumerate(zip(trajectories, advantages if advantages is not None else [0.0] * B)):
        n = len(t.token_ids)
        ids[b, :n] = torch.tensor(t.token_ids)
        attention[b, :n] = 1
        mask[b, :n] = torch.tensor(t.loss_mask, dtype=torch.float)
        old_logp[b, :n] = torch.tensor(t.logprobs)
        adv[b, :n] = torch.as_tensor(a, dtype=torch.float) * mask[b, :n]
    return Batch(ids, attention, mask, old_logp, adv)


def token_micro_batches(rows: torch.Tensor, lengths_R: torch.Tensor, budget: int, world: int = 1) -> list[torch.Tensor]:
    """`rows` (lengths `lengths_R`), longest first, cut into micro-batches whose padded size (rows x the longest)
    is at most `budget` tokens, so that similar lengths go together and little is padding. A row longer than
    `budget` goes alone.

    Sharded over `world` ranks, each micro-batch is the rows of one pass of every rank (rank r takes
    micro[r::world]): every rank's share stays within `budget`, a micro-batch has `world` rows whenever that
    many are left, and all ranks get the same number of passes, as FSDP's collectives need."""
    lengths = lengths_R.tolist()
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep the minibatch's order
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else None
        # the group's first row is its longest; a rank's share of n rows is ceil(n / world) of them
        if g is None or (len(g) >= world and ceil((len(g) + 1) / world) * lengths[g[0]] > budget):
            groups.append([i])
        else:
            g.append(i)
    return [rows[torch.tensor(g)] for g in groups]
