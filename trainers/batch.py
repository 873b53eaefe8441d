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
import torch.nn.functional as F

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


def _sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def token_logprobs(model: torch.nn.Module, ids_BT: torch.Tensor, attention_BT: torch.Tensor,
                   with_entropy: bool = False, mask_BT: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logp_BT[t] = log p(ids[t] | ids[:t]) under `model` (0 at t = 0), and optionally the entropy of
    the distribution that predicted token t.

    Given the loss mask, only masked positions are computed, and outputs elsewhere are 0 (they are never
    trained on):
    - the LM head runs only on the hidden states that predict masked tokens: in agent episodes most
      tokens are prompt and observations, and the [B, T, vocab] logits would dominate time and memory;
    - rows that start with the same prompt (a group, a shared system prompt) run that prefix once: its
      keys and values are computed for one row and repeated, gradients included. Only positions before
      every row's first masked token are shared, so every trained logprob comes from the per-row pass."""
    if mask_BT is None or _sharded(model):  # FSDP gathers parameters in the root's forward: call only that
        logp_BTV = F.log_softmax(model(input_ids=ids_BT, attention_mask=attention_BT).logits[:, :-1].float(), -1)
        logp_BT = F.pad(logp_BTV.gather(-1, ids_BT[:, 1:, None]).squeeze(-1), (1, 0))
        entropy_BT = F.pad(-(logp_BTV.exp() * logp_BTV).sum(-1), (1, 0)) if with_entropy else None
        if mask_BT is not None:  # the same outputs as the masked path: 0 off the mask
            keep_BT = mask_BT > 0
            logp_BT, entropy_BT = logp_BT * keep_BT, entropy_BT * keep_BT if with_entropy else None
        return logp_BT, entropy_BT
    # Gradient checkpointing turns the KV cache off in training, and with it the prefix sharing.
    checkpointing = model.training and getattr(model, "is_gradient_checkpointing", False)
    L = 0 if checkpointing else _shared_prefix_len(ids_BT, mask_BT)
    if L:
        cache = model.base_model(input_ids=ids_BT[:1, :L], use_cache=True).past_key_values
        cache.batch_repeat_interleave(ids_BT.shape[0])
        positions_BT = torch.arange(L, ids_BT.shape[1], device=ids_BT.device).expand(ids_BT.shape[0], -1)
        hidden_BTH = model.base_model(input_ids=ids_BT[:, L:], attention_mask=attention_BT,
                                      position_ids=positions_BT, past_key_values=cache).last_hidden_state
    else:
        hidden_BTH = model.base_model(input_ids=ids_BT, attention_mask=attention_BT,
                                      use_cache=False).last_hidden_state
    # Position t of the hidden states (offset by L) predicts token L + t + 1.
    rows_N, cols_N = (mask_BT[:, L + 1:] > 0).nonzero(as_tuple=True)
    logits_NV = lm_head(model, hidden_BTH[rows_N, cols_N]).float()
    logp_NV = F.log_softmax(logits_NV, dim=-1)
    targets_N = cols_N + L + 1
    logp_BT = torch.zeros(ids_BT.shape, dtype=logp_NV.dtype, device=ids_BT.device)
    logp_BT = logp_BT.index_put((rows_N, targets_N), logp_NV.gather(-1, ids_BT[rows_N, targets_N, None]).squeeze(-1))
    if not with_entropy:
        return logp_BT, None
    entropy_BT = torch.zeros_like(logp_BT).index_put((rows_N, targets_N), -(logp_NV.exp() * logp_NV).sum(-1))
    return logp_BT, entropy_BT


def lm_head(model: torch.nn.Module, hidden_NH: torch.Tensor) -> torch.Tensor:
    """What the model's forward does after its base model: the output projection, and Gemma-2's final
    logit soft-capping where the config has one."""
    logits_NV = model.get_output_embeddings()(hidden_NH)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return cap * torch.tanh(logits_NV / cap) if cap else logits_NV


MIN_SHARED_PREFIX = 32  # below this, a second forward pass costs more than it saves


def _shared_prefix_len(ids_BT: torch.Tensor, mask_BT: torch.Tensor) -> int:
    """Length of the prefix all rows share, ending before the position that predicts any row's first
    masked token; 0 if too short to be worth a separate pass."""
    if ids_BT.shape[0] < 2:
        return 0
    differs_T = (ids_BT != ids_BT[:1]).any(0)
    common = int(differs_T.int().argmax()) if differs_T.any() else ids_BT.shape[1]
    first_masked = int((mask_BT > 0).int().argmax(-1).min())
    L = min(common, first_masked - 1)
    return L if L >= MIN_SHARED_PREFIX else 0
