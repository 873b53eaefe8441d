"""The trainer's logprobs of given token ids: what losses train on and what parity checks compare with the engine.

Memory. The LM head is the trainer's largest tensor: over Qwen's 151,936-token vocabulary, 8k sampled tokens
make [8192, 151936] float32 logits of 5 GB, and the log-softmax, its backward and an entropy in autograd each
another. So the head runs `HEAD_CHUNK` sampled tokens at a time (`head_logprobs`), each chunk under
non-reentrant checkpointing: a chunk's logits live only until its logprobs are gathered, and are recomputed,
one chunk at a time, in the backward. Only the [N] logprobs (and the [N, hidden] states) outlive a chunk.
The entropy is a metric: computed without autograd, last in the chunk, so the backward's recompute stops
before it. The numbers are the unchunked ones up to float rounding (tests/test_logprobs_memory.py).
Measured (`bench/chunked_head.py`: CPU, float32, vocabulary 151,936, hidden 896, 8,192 sampled tokens, forward
and backward with the entropy): 2,484 MiB at its peak in chunks of 1024, against 14,262 MiB at once (0.17);
about 1.1 GB of the chunked peak is the weight's gradient and one chunk's share of it.
Under FSDP the root's parameters (embeddings, final norm, head) are gathered only around a forward of the root,
so `trainers/distributed.py` registers the masked path as one (`SHARDED_FORWARD`): the head again runs on the masked
positions alone, in chunks. Without a mask (or on a sharded model without that method) the head runs inside the
model's forward over every position; only its log-softmax, gather and entropy then go in chunks of rows.

Packing. Agent episodes differ in length (a two-turn episode beside a ten-turn one), and padded rows spend the
decoder's time on padding. With a mask, rows are packed instead (`pack_plan`): each row's tokens up to its last
masked one (causal attention: later tokens change no masked logprob) go into bins of at most the longest row's
length, first-fit by decreasing length, and the decoder runs [bins, width] with position_ids restarting at 0 for
each row and no attention mask, from which transformers builds a block-diagonal causal mask (sdpa, eager; flash
attention runs varlen): no row sees another. A bin's attention costs at most what one padded row's does. The
hidden states at the masked positions then go to the chunked head as before. Packing and prefix sharing do not
combine (transformers detects packed rows only without a KV cache): of the two, the one that runs fewer tokens
is taken, and the padded pass if neither saves `PACK_MIN_SAVING`. Rows without a masked token are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

HEAD_CHUNK = 1024  # sampled tokens per LM-head chunk: [1024, 151936] float32 logits are 0.6 GB
SHARDED_FORWARD = "agentrl_masked_logprobs"  # a sharded model's masked path, run by FSDP as a forward of its root


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether `model` is sharded by FSDP2 (its head's weights are gathered only inside the root's forward)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def token_logprobs(model: torch.nn.Module, ids_BT: torch.Tensor, attention_BT: torch.Tensor,
                   with_entropy: bool = False, mask_BT: torch.Tensor | None = None,
                   head_chunk: int | None = HEAD_CHUNK, pack: bool | None = None, pack_tokens: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logp_BT[t] = log p(ids[t] | ids[:t]) under `model` (0 at t = 0), and optionally the entropy of
    the distribution that predicted token t.

    Given the loss mask, only masked positions are computed, and outputs elsewhere are 0 (they are never
    trained on):
    - the LM head runs only on the hidden states that predict masked tokens: in agent episodes most
      tokens are prompt and observations, and the [B, T, vocab] logits would dominate time and memory;
    - rows that start with the same prompt (a group, a shared system prompt) run that prefix once: its
      keys and values are computed for one row and repeated, gradients included. Only positions before
      every row's first masked token are shared, so every trained logprob comes from the per-row pass;
    - rows of unequal length run packed (`pack_plan`): their tokens up to the last masked one, concatenated
      into bins of at most `pack_tokens` tokens (default: the longest row's). `pack=None` packs when that runs
      fewer tokens than the padded rows or the shared prefix would (by `PACK_MIN_SAVING`); True always packs,
      False never does. The logprobs are the same up to float rounding (tests/test_packing.py)."""
    sharded = is_sharded(model)
    if mask_BT is not None and sharded and hasattr(model, SHARDED_FORWARD):  # FSDP gathers the root around it
        return getattr(model, SHARDED_FORWARD)(ids_BT, attention_BT, with_entropy, mask_BT, head_chunk, pack,
                                               pack_tokens)
    if mask_BT is None or sharded:  # FSDP gathers parameters in the root's forward: call only that
        logits_BTV = model(input_ids=ids_BT, attention_mask=attention_BT).logits[:, :-1]
        # The head ran in the forward, over every position; its float32 log-softmax still goes in chunks of rows.
        rows = None if head_chunk is None else max(1, head_chunk // logits_BTV.shape[1])
        logp_BT, entropy_BT = _in_chunks(None, logits_BTV, ids_BT[:, 1:], with_entropy, rows)
        logp_BT, entropy_BT = F.pad(logp_BT, (1, 0)), F.pad(entropy_BT, (1, 0)) if with_entropy else None
        if mask_BT is not None:  # the same outputs as the masked path: 0 off the mask
            keep_BT = mask_BT > 0
            logp_BT, entropy_BT = logp_BT * keep_BT, entropy_BT * keep_BT if with_entropy else None
        return logp_BT, entropy_BT
    return masked_logprobs(model, ids_BT, attention_BT, with_entropy, mask_BT, head_chunk, pack, pack_tokens)


def masked_logprobs(model: torch.nn.Module, ids_BT: torch.Tensor, attention_BT: torch.Tensor, with_entropy: bool,
                    mask_BT: torch.Tensor, head_chunk: int | None = HEAD_CHUNK, pack: bool | None = None,
                    pack_tokens: int | None = None, share_prefix: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs`' masked path: the decoder over the rows (padded, packed, or after a shared prefix), the
    chunked head on the hidden states that predict masked tokens. Sharded, FSDP runs it as a forward of the root
    (`trainers/distributed.py`), without prefix sharing: every rank must run each decoder layer once per pass (its
    parameters are gathered collectively), which one padded or one packed pass does, and a shared prefix does not."""
    B, T = ids_BT.shape
    # Gradient checkpointing turns the KV cache off in training, and with it the prefix sharing.
    checkpointing = model.training and getattr(model, "is_gradient_checkpointing", False)
    L = 0 if checkpointing or not share_prefix else _shared_prefix_len(ids_BT, mask_BT)
    if pack and not packs(model):
        raise ValueError(f"pack=True needs an attention implementation that keeps packed rows apart, one of "
                         f"{PACKED_ATTENTION}; this model has {getattr(model.config, '_attn_implementation', None)!r}")
    plan = pack_plan(mask_BT, pack_tokens) if pack is not False and packs(model) else None
    unpacked_tokens = L + B * (T - L)  # what the padded pass runs, after the shared prefix if any
    rows_N, targets_N = (mask_BT[:, 1:] > 0).nonzero(as_tuple=True)
    targets_N = targets_N + 1  # the token predicted, by the hidden state at targets_N - 1
    if plan is not None and (pack or plan.tokens <= (1 - PACK_MIN_SAVING) * unpacked_tokens):
        hidden_KWH = model.base_model(input_ids=plan.gather(ids_BT), position_ids=plan.positions_KW.to(ids_BT.device),
                                      attention_mask=None, use_cache=False).last_hidden_state
        bin_B, offset_B = plan.bin_B.to(ids_BT.device), plan.offset_B.to(ids_BT.device)
        hidden_NH = hidden_KWH[bin_B[rows_N], offset_B[rows_N] + targets_N - 1]
    elif L:
        cache = model.base_model(input_ids=ids_BT[:1, :L], use_cache=True).past_key_values
        cache.batch_repeat_interleave(B)
        positions_BT = torch.arange(L, T, device=ids_BT.device).expand(B, -1)
        hidden_BTH = model.base_model(input_ids=ids_BT[:, L:], attention_mask=attention_BT,
                                      position_ids=positions_BT, past_key_values=cache).last_hidden_state
        hidden_NH = hidden_BTH[rows_N, targets_N - 1 - L]  # position t of the suffix pass is L + t
    else:
        hidden_BTH = model.base_model(input_ids=ids_BT, attention_mask=attention_BT,
                                      use_cache=False).last_hidden_state
        hidden_NH = hidden_BTH[rows_N, targets_N - 1]
    logp_N, entropy_N = head_logprobs(model, hidden_NH, ids_BT[rows_N, targets_N], with_entropy, head_chunk)
    logp_BT = torch.zeros(ids_BT.shape, dtype=logp_N.dtype, device=ids_BT.device).index_put((rows_N, targets_N), logp_N)
    if not with_entropy:
        return logp_BT, None
    return logp_BT, torch.zeros_like(logp_BT).index_put((rows_N, targets_N), entropy_N)


def head_logprobs(model: torch.nn.Module, hidden_NH: torch.Tensor, targets_N: torch.Tensor, with_entropy: bool = False,
                  chunk: int | None = HEAD_CHUNK) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp_N, entropy_N): log p(targets_N[n]) under the LM head on hidden_NH[n], and the entropy of that
    distribution (detached; None without `with_entropy`), `chunk` tokens at a time.

    Each chunk runs under non-reentrant checkpointing: its [chunk, vocab] float32 logits are freed as soon as
    its logprobs are gathered and recomputed in the backward, so no [N, vocab] tensor exists at any time.
    `chunk=None` computes all N at once without checkpointing (the reference the chunked head is tested with)."""
    return _in_chunks(model, hidden_NH, targets_N, with_entropy, chunk)


def _in_chunks(model: torch.nn.Module | None, x_NX: torch.Tensor, targets_N: torch.Tensor, with_entropy: bool,
               chunk: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`head_logprobs` over chunks of dim 0 of x (hidden states; or logits, when `model` is None)."""
    if chunk is None:
        return _head_chunk(model, x_NX, targets_N, with_entropy)
    parts = [checkpoint(_head_chunk, model, x_CX, t_C, with_entropy, use_reentrant=False) if torch.is_grad_enabled()
             else _head_chunk(model, x_CX, t_C, with_entropy)  # nothing to recompute without a backward
             for x_CX, t_C in zip(x_NX.split(chunk), targets_N.split(chunk))]
    logp_N = torch.cat([logp_C for logp_C, _ in parts])
    return logp_N, torch.cat([entropy_C for _, entropy_C in parts]) if with_entropy else None


def _head_chunk(model: torch.nn.Module | None, x_CX: torch.Tensor, targets_C: torch.Tensor, with_entropy: bool
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    logp_CV = F.log_softmax((x_CX if model is None else lm_head(model, x_CX)).float(), dim=-1)
    logp_C = logp_CV.gather(-1, targets_C[..., None]).squeeze(-1)
    if not with_entropy:
        return logp_C, None
    # Last, and without autograd: entropy is only a metric, and the checkpoint's recompute stops before it
    # (it has recomputed every tensor the backward needs by then).
    with torch.no_grad():
        entropy_C = -logp_CV.exp().mul_(logp_CV).sum(-1)
    return logp_C, entropy_C


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
    masked_BT = mask_BT > 0
    has_B = masked_BT.any(-1)  # a row with nothing sampled does not limit the prefix
    if not has_B.any():
        return 0
    first_masked = int(masked_BT.int().argmax(-1)[has_B].min())
    L = min(common, first_masked - 1)
    return L if L >= MIN_SHARED_PREFIX else 0


# Packing.
PACK_MIN_SAVING = 0.1  # pack only when it runs at least this share fewer tokens: the copies in and out cost some
# Attention implementations that keep packed segments apart, given position_ids restarting at 0 and no attention
# mask: transformers' masking_utils builds a block-diagonal causal mask for these (flash attention runs varlen).
PACKED_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")


def packs(model: torch.nn.Module) -> bool:
    """Whether `model`'s attention keeps packed segments apart (see `PACKED_ATTENTION`)."""
    return getattr(model.config, "_attn_implementation", None) in PACKED_ATTENTION


@dataclass(frozen=True)
class PackPlan:
    """Where each row's tokens go in the packed [K, W] layout: row b's first `length_B[b]` tokens at
    bin_B[b], columns offset_B[b]...; positions restart at 0 for every row (and for a bin's padding at its end)."""

    bin_B: torch.Tensor  # long; -1 for a row left out (nothing to predict)
    offset_B: torch.Tensor  # long
    length_B: torch.Tensor  # long; 0 for a row left out
    positions_KW: torch.Tensor  # long, the position_ids of the packed pass

    @property
    def tokens(self) -> int:
        """Tokens the packed pass runs, padding included."""
        return self.positions_KW.numel()

    def gather(self, ids_BT: torch.Tensor) -> torch.Tensor:
        """ids_KW: the rows' tokens in the packed layout (0 on padding)."""
        rows = (self.length_B > 0).nonzero().squeeze(-1)
        src_r = torch.repeat_interleave(rows, self.length_B[rows])
        starts = torch.cumsum(self.length_B[rows], 0) - self.length_B[rows]
        src_c = torch.arange(len(src_r)) - torch.repeat_interleave(starts, self.length_B[rows])
        dst_k, dst_c = self.bin_B[src_r], self.offset_B[src_r] + src_c
        device = ids_BT.device
        ids_KW = ids_BT.new_zeros(self.positions_KW.shape)
        ids_KW[dst_k.to(device), dst_c.to(device)] = ids_BT[src_r.to(device), src_c.to(device)]
        return ids_KW


def pack_plan(mask_BT: torch.Tensor, budget: int | None = None) -> PackPlan | None:
    """Bins of at most `budget` tokens (default: the longest row's), filled first-fit by decreasing length with
    each row's tokens up to its last masked one (the later ones cannot change any masked logprob); a row longer
    than `budget` gets a bin of its own. A bin's attention then costs at most what one padded row's does.
    None if no row has a masked token to predict."""
    masked_BT = (mask_BT > 0).cpu()
    masked_BT[:, 0] = False  # position 0 is never predicted
    T = masked_BT.shape[1]
    # Predicting token t takes tokens [0, t): the row's length is its last masked position (0: none).
    last_B = torch.where(masked_BT.any(1), T - 1 - masked_BT.flip(1).int().argmax(1), 0)
    lengths = last_B.tolist()
    if not any(lengths):
        return None
    if budget is not None and budget < 1:
        raise ValueError(f"pack_tokens must be >= 1, got {budget}")
    budget = budget or max(lengths)
    fills: list[int] = []
    bin_B, offset_B = [-1] * len(lengths), [0] * len(lengths)
    for b in sorted((b for b, n in enumerate(lengths) if n), key=lambda b: -lengths[b]):
        k = next((k for k, f in enumerate(fills) if f + lengths[b] <= budget), len(fills))
        if k == len(fills):
            fills.append(0)
        bin_B[b], offset_B[b] = k, fills[k]
        fills[k] += lengths[b]
    W = max(fills)
    positions_KW = torch.zeros((len(fills), W), dtype=torch.long)
    for b, n in enumerate(lengths):
        if n:
            positions_KW[bin_B[b], offset_B[b]:offset_B[b] + n] = torch.arange(n)
    for k, f in enumerate(fills):  # the padding is a segment of its own: it attends only to itself
        positions_KW[k, f:] = torch.arange(W - f)
    return PackPlan(torch.tensor(bin_B), torch.tensor(offset_B), last_B, positions_KW)
