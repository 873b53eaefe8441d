"""The trainer's logprobs of given token ids: what losses train on and what parity checks compare with the engine."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
