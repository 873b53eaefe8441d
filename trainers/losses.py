"""Loss functions: pure functions of tensors, each `(tensors) -> (loss, metrics)`.

Shapes are in the names: `_B` sequences, `_T` token positions, `_V` vocabulary. `mask_BT` is the
trajectory's loss mask: 1 exactly on sampled tokens. Only positions with mask 1 ever contribute to a loss,
a KL, an entropy or a metric: every function first replaces the inputs at mask-0 positions with zeros via
`torch.where`, so whatever sits there (even inf or nan) changes neither the values nor the gradients, and the
gradient at those positions is exactly 0.

Policy losses share one signature and are chosen by name from `POLICY_LOSSES`:
    fn(logp_BT, old_logp_BT, adv_BT, mask_BT, cfg: PolicyLossConfig) -> (loss, metrics)
`old_logp_BT` and `adv_BT` are treated as constants (detached). Metrics are plain floats over masked tokens.

The sampler/trainer correction (`tis_weights`, `mis_keep`, `mismatch_metrics`, `rollout_correction`) turns the
sampler's and the trainer's logprobs of the same sampled tokens into constant per-token weights and a mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import with_config
from torch import Tensor

from agentrl.config import STRICT

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3")
CorrectionLevel = Literal["token", "sequence"]


def masked_mean(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Mean of x over the positions where mask_BT == 1 (0 when there are none)."""
    m = mask_BT.bool()
    return torch.where(m, x_BT, 0.0).sum() / m.sum().clamp(min=1)


def aggregate(loss_BT: Tensor, mask_BT: Tensor, mode: str, *, norm_const: float | None = None) -> Tensor:
    """Reduces a per-token loss to a scalar over the mask-1 positions.

    token-mean               sum_{b,t} l / sum_{b,t} m            (every token weighs the same; DAPO)
    seq-mean-token-mean      mean_b [ sum_t l / sum_t m ]         (every sequence weighs the same; GRPO paper)
    seq-mean-token-sum       mean_b [ sum_t l ]
    seq-mean-token-sum-norm  mean_b [ sum_t l / norm_const ]      (a fixed divisor, e.g. the max length; Dr.GRPO)

    mean_b runs over the sequences with at least one mask-1 token, so all-masked rows (padding, or
    trajectories kept out of the loss) change nothing. `norm_const` is required by the last mode and an error
    with the others.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; modes: {', '.join(AGG_MODES)}")
    if (mode == "seq-mean-token-sum-norm") != (norm_const is not None):
        raise ValueError(f"norm_const is used by 'seq-mean-token-sum-norm' only (mode {mode!r}, "
                         f"norm_const {norm_const!r})")
    if mode == "token-mean":
        return masked_mean(loss_BT, mask_BT)
    m = mask_BT.bool()
    tokens_B = m.sum(-1)
    seq_B = torch.where(m, loss_BT, 0.0).sum(-1)
    if mode == "seq-mean-token-mean":
        seq_B = seq_B / tokens_B.clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        seq_B = seq_B / norm_const
    return seq_B.sum() / (tokens_B > 0).sum().clamp(min=1)


def micro_batch_weight(micro_mask_BT: Tensor, minibatch_mask_BT: Tensor, mode: str) -> float:
    """The factor that makes gradient accumulation exact: summing `weight * aggregate(micro)` over the
    micro-batches of a minibatch equals `aggregate(minibatch)`. token-mean weighs by the micro-batch's share
    of the masked tokens, the seq-mean modes by its share of the sequences that have any."""
    if mode == "token-mean":
        return (micro_mask_BT > 0).sum().item() / max((minibatch_mask_BT > 0).sum().item(), 1)
    rows = lambda mask_BT: ((mask_BT > 0).sum(-1) > 0).sum().item()  # noqa: E731
    return rows(micro_mask_BT) / max(rows(minibatch_mask_BT), 1)


@with_config(STRICT)
@dataclass(frozen=True)
class PolicyLossConfig:
    """Options of the policy losses; each loss reads the fields it names in its docstring."""

    clip_low: float = 0.2  # the ratio is clipped below at 1 - clip_low
    clip_high: float = 0.2  # and above at 1 + clip_high; larger than clip_low is DAPO's clip-higher (0.28)
    dual_clip: float | None = None  # c > 1: for A < 0 the token loss is capped at c * |A| (Ye et al. 2020)
    agg: str = "token-mean"  # one of AGG_MODES
    norm_const: float | None = None  # the fixed divisor of "seq-mean-token-sum-norm", e.g. max new tokens
    # Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs"), paper defaults:
    clip_cov_ratio: float = 2e-4  # Clip-Cov: fraction r of the tokens whose gradient is detached
    clip_cov_lb: float = 1.0  # Clip-Cov: candidates have covariance in (lb, ub)
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-3  # KL-Cov: fraction k of tokens with the largest covariance (2e-4 at 32B)
    kl_cov_coef: float = 1.0  # KL-Cov: beta, the weight of |log ratio| on those tokens

    def __post_init__(self) -> None:
        problems = []
        if not 0.0 <= self.clip_low < 1.0:
            problems.append(f"clip_low must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0.0:
            problems.append(f"clip_high must be >= 0, got {self.clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            problems.append(f"dual_clip must be > 1 (e.g. 3.0) or None, got {self.dual_clip}")
        if self.agg not in AGG_MODES:
            problems.append(f"agg must be one of {', '.join(AGG_MODES)}, got {self.agg!r}")
        if (self.agg == "seq-mean-token-sum-norm") != (self.norm_const is not None):
            problems.append("norm_const must be set exactly when agg is 'seq-mean-token-sum-norm'")
        if self.norm_const is not None and self.norm_const <= 0:
            problems.append(f"norm_const must be > 0, got {self.norm_const}")
        if not 0.0 < self.clip_cov_ratio <= 1.0 or not 0.0 < self.kl_cov_ratio <= 1.0:
            problems.append("clip_cov_ratio and kl_cov_ratio must be in (0, 1]")
        if self.clip_cov_lb >= self.clip_cov_ub:
            problems.append(f"clip_cov_lb ({self.clip_cov_lb}) must be < clip_cov_ub ({self.clip_cov_ub})")
        if self.kl_cov_coef < 0.0:
            problems.append(f"kl_cov_coef must be >= 0, got {self.kl_cov_coef}")
        if problems:
            raise ValueError("invalid PolicyLossConfig: " + "; ".join(problems))


def _masked(mask_BT: Tensor, x_BT: Tensor, *constants_BT: Tensor) -> tuple[Tensor, ...]:
    """The inputs with mask-0 positions replaced by 0; the constants are also detached."""
    m = mask_BT.bool()
    for c in constants_BT:
        if c.shape != x_BT.shape:
            raise ValueError(f"shape mismatch: {tuple(x_BT.shape)} vs {tuple(c.shape)}")
    if m.shape != x_BT.shape:
        raise ValueError(f"mask has shape {tuple(m.shape)}, inputs {tuple(x_BT.shape)}")
    return (m, torch.where(m, x_BT, 0.0), *(torch.where(m, c.detach(), 0.0) for c in constants_BT))


def _clipped_surrogate(ratio_BT: Tensor, adv_BT: Tensor, m: Tensor,
                       cfg: PolicyLossConfig) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's per-token loss max(-A r, -A clip(r, 1-low, 1+high)), with the dual clip for A < 0.
    Returns (loss_BT, clipped_BT, dual_clipped_BT): where each clip is the active branch."""
    unclipped = -adv_BT * ratio_BT
    clipped = -adv_BT * ratio_BT.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(m)
    if cfg.dual_clip is not None:
        # For A < 0 and a ratio far above 1, -A r grows without bound: cap it at -A c (its gradient is 0 there).
        cap = -adv_BT * cfg.dual_clip
        dual_active = (adv_BT < 0) & (loss > cap) & m
        loss = torch.where(dual_active, cap, loss)
    return loss, (clipped > unclipped) & m & ~dual_active, dual_active


@torch.no_grad()
def _ratio_metrics(ratio_BT: Tensor, log_ratio_BT: Tensor, m: Tensor, clipped_BT: Tensor) -> dict[str, float]:
    ratios = ratio_BT[m]
    return {
        "clip_frac": masked_mean(clipped_BT.float(), m).item(),
        "ratio_mean": masked_mean(ratio_BT, m).item(),
        "ratio_max": ratios.max().item() if ratios.numel() else 1.0,
        "ratio_min": ratios.min().item() if ratios.numel() else 1.0,
        # k3 estimate of KL(pi_old || pi) from the pi_old samples: (r - 1) - log r >= 0.
        "approx_kl": masked_mean(log_ratio_BT.exp() - 1.0 - log_ratio_BT, m).item(),
    }


def ppo_clip_loss(logp_BT: Tensor, old_logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor,
                  cfg: PolicyLossConfig) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped surrogate (Schulman et al. 2017) per token, r = exp(logp - old_logp):

        l_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))        (clip_high > clip_low: DAPO)
        l_t = min(l_t, -c A_t)   for A_t < 0, with c = dual_clip                 (dual-clip PPO)

    aggregated with `cfg.agg`. Metrics: clip_frac (tokens where the low/high clip is the active branch),
    dual_clip_frac, ratio_mean/min/max, approx_kl.
    """
    m, logp, old, adv = _masked(mask_BT, logp_BT, old_logp_BT, adv_BT)
    log_ratio = logp - old
    ratio = log_ratio.exp()
    loss_BT, clipped, dual = _clipped_surrogate(ratio, adv, m, cfg)
    metrics = _ratio_metrics(ratio, log_ratio, m, clipped)
    metrics["dual_clip_frac"] = masked_mean(dual.float(), m).item()
    return aggregate(loss_BT, m, cfg.agg, norm_const=cfg.norm_const), metrics


def gspo_loss(logp_BT: Tensor, old_logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor,
              cfg: PolicyLossConfig) -> tuple[Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): one importance ratio per sequence,

        s_i = exp( (1/|y_i|) sum_t (logp_t - old_logp_t) )        (mean over the sequence's masked tokens)

    clipped per sequence at [1 - clip_low, 1 + clip_high]. Written in the paper's GSPO-token form,
    s_{i,t} = sg[s_i] * exp(logp_t - sg[logp_t]), so that a per-token advantage is allowed; with a constant
    advantage per sequence and agg="seq-mean-token-mean" the loss and its gradient equal the paper's
    sequence-level objective. The paper's clip ranges are tiny (3e-4 / 4e-4) because s_i is a geometric
    mean. dual_clip is a token-level PPO option and is an error here. ratio_* metrics describe s_i.
    """
    if cfg.dual_clip is not None:
        raise ValueError("gspo_loss clips the sequence ratio only; set dual_clip=None")
    m, logp, old, adv = _masked(mask_BT, logp_BT, old_logp_BT, adv_BT)
    log_ratio = logp - old  # 0 at mask-0 positions
    seq_log_ratio_B = log_ratio.sum(-1) / m.sum(-1).clamp(min=1)
    ratio = torch.exp(seq_log_ratio_B.detach()[:, None] + logp - logp.detach())
    loss_BT, clipped, _ = _clipped_surrogate(ratio, adv, m, cfg)
    metrics = _ratio_metrics(ratio, log_ratio, m, clipped)
    return aggregate(loss_BT, m, cfg.agg, norm_const=cfg.norm_const), metrics


@torch.no_grad()
def _token_covariance(logp_BT: Tensor, adv_BT: Tensor, m: Tensor) -> Tensor:
    """Cov_t = (A_t - mean A)(logp_t - mean logp) with means over masked tokens; -inf at mask-0 positions."""
    cov = (adv_BT - masked_mean(adv_BT, m)) * (logp_BT - masked_mean(logp_BT, m))
    return torch.where(m, cov, -torch.inf)


def clip_cov_loss(logp_BT: Tensor, old_logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor,
                  cfg: PolicyLossConfig) -> tuple[Tensor, dict[str, float]]:
    """Clip-Cov (Cui et al. 2025, eq. 8): the PPO loss of `ppo_clip_loss`, except that the gradient of a few
    high-covariance tokens is detached. Candidates: masked tokens not already clipped whose covariance
    Cov_t = (A_t - mean A)(logp_t - mean logp) lies in (clip_cov_lb, clip_cov_ub); max(1, int(clip_cov_ratio *
    N)) of them (N = masked tokens) are drawn uniformly at random with torch's global RNG, as in the paper.
    Detached tokens keep their loss value but pass no gradient. Extra metric: cov_detach_frac.
    """
    m, logp, old, adv = _masked(mask_BT, logp_BT, old_logp_BT, adv_BT)
    log_ratio = logp - old
    ratio = log_ratio.exp()
    loss_BT, clipped, dual = _clipped_surrogate(ratio, adv, m, cfg)
    cov = _token_covariance(logp, adv, m)
    candidates = m & ~clipped & ~dual & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
    idx = candidates.flatten().nonzero().squeeze(1)
    n_detach = max(1, int(cfg.clip_cov_ratio * int(m.sum())))
    chosen = idx[torch.randperm(idx.numel(), device=idx.device)[:n_detach]]
    detach = torch.zeros(m.numel(), dtype=torch.bool, device=m.device)
    detach[chosen] = True
    detach = detach.view_as(m)
    loss_BT = torch.where(detach, loss_BT.detach(), loss_BT)
    metrics = _ratio_metrics(ratio, log_ratio, m, clipped)
    metrics["cov_detach_frac"] = masked_mean(detach.float(), m).item()
    return aggregate(loss_BT, m, cfg.agg, norm_const=cfg.norm_const), metrics


def kl_cov_loss(logp_BT: Tensor, old_logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor,
                cfg: PolicyLossConfig) -> tuple[Tensor, dict[str, float]]:
    """KL-Cov (Cui et al. 2025, eq. 9): the unclipped surrogate -A_t r_t on every token, plus
    kl_cov_coef * |logp_t - old_logp_t| on the max(1, int(kl_cov_ratio * N)) masked tokens with the largest
    covariance Cov_t (see `clip_cov_loss`). The penalty replaces ratio clipping, so clip_low/clip_high are not
    used (clip_frac is 0) and dual_clip is an error. Extra metric: kl_cov_frac.
    """
    if cfg.dual_clip is not None:
        raise ValueError("kl_cov_loss does not clip (the covariance penalty replaces clipping); set dual_clip=None")
    m, logp, old, adv = _masked(mask_BT, logp_BT, old_logp_BT, adv_BT)
    log_ratio = logp - old
    ratio = log_ratio.exp()
    cov = _token_covariance(logp, adv, m).flatten()
    n_tokens = int(m.sum())
    penalized = torch.zeros(m.numel(), dtype=torch.bool, device=m.device)
    if n_tokens:
        penalized[cov.topk(max(1, int(cfg.kl_cov_ratio * n_tokens))).indices] = True
    penalized = penalized.view_as(m)
    loss_BT = -adv * ratio + torch.where(penalized, cfg.kl_cov_coef * log_ratio.abs(), 0.0)
    metrics = _ratio_metrics(ratio, log_ratio, m, torch.zeros_like(m))
    metrics["kl_cov_frac"] = masked_mean(penalized.float(), m).item()
    return aggregate(loss_BT, m, cfg.agg, norm_const=cfg.norm_const), metrics


PolicyLossFn = Callable[[Tensor, Tensor, Tensor, Tensor, PolicyLossConfig], tuple[Tensor, dict[str, float]]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo": ppo_clip_loss,
    "gspo": gspo_loss,
    "clip_cov": clip_cov_loss,
    "kl_cov": kl_cov_loss,
}
# The losses in which a sequence's loss and gradient are its advantage times a function of its own tokens only: a
# sequence whose advantages are all 0 contributes nothing (the trainer skips its forward pass).
ADVANTAGE_WEIGHTED = frozenset({"ppo", "gspo"})


def kl_estimate(logp_BT: Tensor, ref_logp_BT: Tensor, kind: str) -> Tensor:
    """Per-token estimates of KL(pi || ref) from tokens sampled from pi (Schulman 2020, "Approximating KL
    divergence"), with r = ref(x) / pi(x):

        k1 = -log r = logp - ref_logp          unbiased, high variance, can be negative
        k2 = (log r)^2 / 2                     biased, low variance, >= 0
        k3 = (r - 1) - log r                   unbiased, low variance, >= 0   (GRPO's KL term)

    As loss terms on on-policy samples, the gradients differ from the values: k2's gradient is that of
    KL(pi || ref); k3's is that of the forward KL(ref || pi); k1's is 0 in expectation (use it in the
    reward, not as a loss). Elementwise, no mask: reduce with `kl_loss` or `masked_mean`.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; kinds: {', '.join(KL_KINDS)}")
    log_ratio = logp_BT - ref_logp_BT  # log pi/ref = -log r
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    return torch.exp(-log_ratio) - 1.0 + log_ratio


def kl_loss(logp_BT: Tensor, ref_logp_BT: Tensor, mask_BT: Tensor, kind: str, agg: str = "token-mean", *,
            norm_const: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """The KL-to-reference loss term: `aggregate(kl_estimate(logp, ref_logp, kind), mask, agg)`. The caller
    multiplies by its coefficient. `ref_logp_BT` is a constant. Metrics: kl (token mean), kl_max."""
    m, logp, ref = _masked(mask_BT, logp_BT, ref_logp_BT)
    kl_BT = kl_estimate(logp, ref, kind)
    with torch.no_grad():
        values = kl_BT[m]
        metrics = {"kl": masked_mean(kl_BT, m).item(), "kl_max": values.max().item() if values.numel() else 0.0}
    return aggregate(kl_BT, m, agg, norm_const=norm_const), metrics


def kl_in_reward(rewards_BT: Tensor, logp_BT: Tensor, ref_logp_BT: Tensor, mask_BT: Tensor, *, beta: float,
                 kind: str = "k1") -> Tensor:
    """Token rewards with the KL penalty folded in, for PPO / REINFORCE++: r_t - beta * KL_t on mask-1
    positions, r_t unchanged elsewhere. The result is a constant (no gradient). Returns rewards_BT."""
    m, logp, ref = _masked(mask_BT, logp_BT.detach(), ref_logp_BT)
    return rewards_BT - torch.where(m, beta * kl_estimate(logp, ref, kind), 0.0)


# --- the sampler/trainer correction (verl's rollout correction: TIS and MIS) -------------------------------


@with_config(STRICT)
@dataclass(frozen=True)
class CorrectionConfig:
    """The correction for the gap between the sampler's logprobs (a bf16 engine, or older weights) and the
    trainer's, as verl's `rollout_corr_helper` does it: decoupled PPO, TIS and MIS (`rollout_correction`)."""

    decoupled: bool = False  # recompute old logprobs with the trainer before the epochs: the PPO ratio's anchor
    tis: CorrectionLevel | None = None  # truncated importance weight per token, or one per sequence
    tis_cap: float = 2.0  # C of TIS: weights are min(w, C) (verl's rollout_is_threshold)
    mis: CorrectionLevel | None = None  # mask tokens (or whole sequences) whose weight is outside [1/C, C]
    mis_threshold: float = 2.0  # C of MIS (verl's rollout_rs_threshold; the lower bound is 1/C)

    def __post_init__(self) -> None:
        problems = []
        if (self.tis or self.mis) and not self.decoupled:
            problems.append("tis and mis weigh the trainer's recomputed logprobs against the sampler's: set "
                            "decoupled = true (without it both are the sampler's, and every weight is 1)")
        if self.tis_cap <= 0:
            problems.append(f"tis_cap must be > 0 (e.g. 2.0), got {self.tis_cap}")
        if self.mis_threshold <= 1:
            problems.append(f"mis_threshold must be > 1 (the kept weights are [1/C, C]), got {self.mis_threshold}")
        if problems:
            raise ValueError("invalid CorrectionConfig: " + "; ".join(problems))


def _log_weight(trainer_logp_BT: Tensor, sampler_logp_BT: Tensor, mask_BT: Tensor,
                level: str) -> tuple[Tensor, Tensor]:
    """(m, log_w_BT): log(pi_trainer / pi_sampler) per masked token (0 elsewhere), detached; at level "sequence"
    each masked token holds its sequence's sum (the log of the product of its tokens' ratios)."""
    if level not in ("token", "sequence"):
        raise ValueError(f"correction level must be 'token' or 'sequence', got {level!r}")
    m, trainer, sampler = _masked(mask_BT, trainer_logp_BT.detach(), sampler_logp_BT)
    log_w = trainer - sampler
    if level == "sequence":
        log_w = torch.where(m, log_w.sum(-1, keepdim=True), 0.0)
    return m, log_w


@torch.no_grad()
def tis_weights(trainer_logp_BT: Tensor, sampler_logp_BT: Tensor, mask_BT: Tensor, *, cap: float = 2.0,
                level: str = "token") -> tuple[Tensor, dict[str, float]]:
    """Truncated importance sampling (TIS): the constant per-token weight

        token:     w_t = min(exp(trainer_t - sampler_t), C)
        sequence:  w_t = min(exp(sum_s m_s (trainer_s - sampler_s)), C)   on every masked token of the sequence

    that makes a loss on the sampler's tokens estimate the trainer's expectation, with C bounding the variance
    (verl's `rollout_is`: the upper truncation only). 0 at mask-0 positions; never has a gradient. Metrics:
    tis_truncated_frac (masked tokens whose weight was capped), tis_weight_mean (after the cap).
    """
    m, log_w = _log_weight(trainer_logp_BT, sampler_logp_BT, mask_BT, level)
    raw = torch.where(m, log_w.exp(), 0.0)
    weights = raw.clamp(max=cap)
    metrics = {"tis_truncated_frac": masked_mean((raw > cap).float(), m).item(),
               "tis_weight_mean": masked_mean(weights, m).item()}
    return weights, metrics


@torch.no_grad()
def mis_keep(trainer_logp_BT: Tensor, sampler_logp_BT: Tensor, mask_BT: Tensor, *, threshold: float = 2.0,
             level: str = "token") -> tuple[Tensor, dict[str, float]]:
    """Masked importance sampling (MIS; verl's rejection sampling `rollout_rs`): keep_BT is 1 on the masked
    tokens whose importance weight w (per token, or the sequence's product as in `tis_weights`) lies in
    [1/C, C], 0 elsewhere. The caller multiplies the loss mask by it, so a rejected token leaves the loss and
    its normalisation, as in verl; the kept ones keep weight 1 (TIS may weigh them too). Metric: mis_masked_frac
    (masked tokens rejected).
    """
    m, log_w = _log_weight(trainer_logp_BT, sampler_logp_BT, mask_BT, level)
    w = log_w.exp()
    keep = m & (w >= 1.0 / threshold) & (w <= threshold)
    return keep.to(mask_BT.dtype), {"mis_masked_frac": masked_mean((m & ~keep).float(), m).item()}


@torch.no_grad()
def mismatch_metrics(trainer_logp_BT: Tensor, sampler_logp_BT: Tensor, mask_BT: Tensor) -> dict[str, float]:
    """How far the sampler is from the trainer on the sampler's own tokens, over masked tokens:

        mismatch_kl_k1   mean(sampler - trainer)                     KL(sampler || trainer), k1: unbiased, can be < 0
        mismatch_kl_k3   mean(r - 1 - log r), r = exp(trainer - sampler)     k3: unbiased, >= 0 (`kl_estimate`)
        mismatch_abs_dp  mean |exp(trainer) - exp(sampler)|          (verl's rollout_probs_diff_mean)
        is_weight_p05, _p50, _p95, _max   quantiles of the per-token importance weight r (stale samples widen them)
    """
    m, trainer, sampler = _masked(mask_BT, trainer_logp_BT.detach(), sampler_logp_BT)
    r = (trainer - sampler)[m].float().exp()
    quantiles = torch.quantile(r, torch.tensor([0.05, 0.5, 0.95])).tolist() if r.numel() else [1.0] * 3
    return {"mismatch_kl_k1": masked_mean(kl_estimate(sampler, trainer, "k1"), m).item(),
            "mismatch_kl_k3": masked_mean(kl_estimate(sampler, trainer, "k3"), m).item(),
            "mismatch_abs_dp": masked_mean((trainer.exp() - sampler.exp()).abs(), m).item(),
            **dict(zip(("is_weight_p05", "is_weight_p50", "is_weight_p95"), quantiles)),
            "is_weight_max": r.max().item() if r.numel() else 1.0}


@torch.no_grad()
def rollout_correction(trainer_logp_BT: Tensor, sampler_logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor,
                       cfg: CorrectionConfig) -> tuple[Tensor, Tensor, dict[str, float]]:
    """(adv_BT, mask_BT, metrics) for a policy loss whose old logprobs are the trainer's (`trainer_logp_BT`):
    the TIS weight folded into the advantage (adv * w), and the MIS rejections taken out of the mask. Both weigh
    against the mask and advantage given, so TIS and MIS compose as in verl (IS weights on the kept tokens).

    Folding w >= 0 into A is exact for PPO's clipped loss: max(-wA r, -wA clip(r)) = w max(-A r, -A clip(r)),
    and the dual-clip cap -wAc = w(-Ac) with the same sign condition, so the per-token loss and its gradient are
    w times the unweighted ones (GSPO's surrogate too). The covariance losses read A itself: see `LoopConfig`.
    Metrics: `mismatch_metrics` on the tokens given, and those of TIS/MIS when on.
    """
    metrics = mismatch_metrics(trainer_logp_BT, sampler_logp_BT, mask_BT)
    m, adv = _masked(mask_BT, adv_BT)[:2]
    mask_out = m.to(mask_BT.dtype)
    if cfg.mis is not None:
        keep, mis_metrics = mis_keep(trainer_logp_BT, sampler_logp_BT, mask_BT, threshold=cfg.mis_threshold,
                                     level=cfg.mis)
        mask_out, metrics = mask_out * keep, {**metrics, **mis_metrics}
    if cfg.tis is not None:
        weights, tis_metrics = tis_weights(trainer_logp_BT, sampler_logp_BT, mask_BT, cap=cfg.tis_cap, level=cfg.tis)
        adv, metrics = adv * weights, {**metrics, **tis_metrics}
    return torch.where(mask_out > 0, adv, 0.0), mask_out, metrics


def value_loss(values_BT: Tensor, old_values_BT: Tensor, returns_BT: Tensor, mask_BT: Tensor, *,
               clip: float | None = 0.2, agg: str = "token-mean",
               norm_const: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped value loss: with V' = old_V + clip(V - old_V, -clip, clip),

        l_t = 0.5 * max((V_t - R_t)^2, (V'_t - R_t)^2)         (clip=None: 0.5 * (V_t - R_t)^2)

    aggregated with `agg`. `old_values_BT` and `returns_BT` are constants. Metrics: value_clip_frac (the
    clipped error is the larger one), value_mean, value_mse (unclipped).
    """
    m, v, old, ret = _masked(mask_BT, values_BT, old_values_BT, returns_BT)
    unclipped = (v - ret).square()
    loss_BT, clipped = unclipped, torch.zeros_like(m)
    if clip is not None:
        clipped_error = (old + (v - old).clamp(-clip, clip) - ret).square()
        loss_BT = torch.maximum(unclipped, clipped_error)
        clipped = (clipped_error > unclipped) & m
    with torch.no_grad():
        metrics = {"value_clip_frac": masked_mean(clipped.float(), m).item(),
                   "value_mean": masked_mean(v, m).item(), "value_mse": masked_mean(unclipped, m).item()}
    return 0.5 * aggregate(loss_BT, m, agg, norm_const=norm_const), metrics


def dpo_loss(logp_BT: Tensor, ref_logp_BT: Tensor, mask_BT: Tensor, *, beta: float = 0.1,
             label_smoothing: float = 0.0) -> tuple[Tensor, dict[str, float]]:
    """DPO (Rafailov et al. 2023) on pairs: rows 2i and 2i+1 of the batch are the chosen and the rejected
    trajectory of pair i. With sequence log-probabilities s = sum_t m_t logp_t (sampled tokens only),

        z_i  = beta * [(s_chosen - s_ref_chosen) - (s_rejected - s_ref_rejected)]
        loss = mean_i [ -(1 - eps) * log sigmoid(z_i) - eps * log sigmoid(-z_i) ]     (eps: label_smoothing,
                                                                                     cDPO; 0 = plain DPO)
    `ref_logp_BT` is a constant. Metrics: reward_accuracy (z > 0), reward_margin (mean z / beta).
    """
    if logp_BT.shape[0] % 2:
        raise ValueError(f"DPO needs (chosen, rejected) row pairs; got {logp_BT.shape[0]} rows")
    m, logp, ref = _masked(mask_BT, logp_BT, ref_logp_BT)
    s_B = torch.where(m, logp - ref, 0.0).sum(-1)  # implicit reward / beta of each row
    margin_P = s_B[0::2] - s_B[1::2]
    z_P = beta * margin_P
    loss = -((1 - label_smoothing) * F.logsigmoid(z_P) + label_smoothing * F.logsigmoid(-z_P)).mean()
    with torch.no_grad():
        metrics = {"reward_accuracy": (z_P > 0).float().mean().item(), "reward_margin": margin_P.mean().item()}
    return loss, metrics
