"""Advantage estimators: pure functions from rewards (and values) to advantages.

Shapes are in the names: `_G` one group (G trajectories of one task), `_B` a batch of trajectories, `_T`
token positions, `_K` turns. A `valid` mask marks trajectories that count towards baselines; `error`
trajectories are invalid (DESIGN.md, "Failures are data"): they are left out of every mean and std and get
advantage 0, never a score of 0.

Conventions, once for the whole module:
- std is Bessel-corrected (`torch.std`'s default, as in DeepSeekMath's GRPO, TRL and verl), and `eps` is
  added to the std, not to the variance. A set with fewer than two valid entries has no spread: its
  advantages are 0.
- Token-level outputs are 0 wherever `mask_BT == 0` (prompt and observation tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import Tensor


def _valid_or_all(rewards: Tensor, valid: Tensor | None) -> Tensor:
    if valid is None:
        return torch.ones_like(rewards, dtype=torch.bool)
    if valid.shape != rewards.shape:
        raise ValueError(f"valid has shape {tuple(valid.shape)}, rewards {tuple(rewards.shape)}")
    return valid.bool()


def _whiten(x: Tensor, valid: Tensor, *, scale_by_std: bool, eps: float) -> Tensor:
    """(x - mean) / (std + eps) over the valid entries of a 1-D tensor; 0 for invalid ones."""
    out = torch.zeros_like(x)
    if int(valid.sum()) < 2:
        return out
    xv = x[valid]
    centered = xv - xv.mean()
    out[valid] = centered / (xv.std() + eps) if scale_by_std else centered
    return out


def grpo_advantages(rewards_G: Tensor, valid_G: Tensor | None = None, *, scale_by_std: bool = True,
                    eps: float = 1e-6) -> Tensor:
    """GRPO's group-normalized advantage (Shao et al. 2024, DeepSeekMath, eq. 3 outcome supervision):

        A_i = (r_i - mean_j r_j) / (std_j r_j + eps)      over the valid members j of the group.

    `scale_by_std=False` is Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): A_i = r_i -
    mean_j r_j, which removes the bias towards groups with little spread. Returns adv_G.
    """
    valid = _valid_or_all(rewards_G, valid_G)
    return _whiten(rewards_G.float(), valid, scale_by_std=scale_by_std, eps=eps)


def rloo_advantages(rewards_G: Tensor, valid_G: Tensor | None = None) -> Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024):

        A_i = r_i - 1/(n-1) * sum_{j != i} r_j  =  n/(n-1) * (r_i - mean_j r_j)

    over the n valid members of the group. A group with one valid member has no baseline: A = 0.
    """
    valid = _valid_or_all(rewards_G, valid_G)
    out = torch.zeros_like(rewards_G, dtype=torch.float32)
    n = int(valid.sum())
    if n < 2:
        return out
    r = rewards_G.float()[valid]
    out[valid] = r - (r.sum() - r) / (n - 1)
    return out


def reinforce_pp_advantages(rewards_B: Tensor, valid_B: Tensor | None = None, *,
                            group_ids_B: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """REINFORCE++ (Hu et al. 2025, arXiv:2501.03262), per trajectory:

        A_i = (R_i - mean_batch R) / (std_batch R + eps)

    With `group_ids_B` this is REINFORCE++-baseline: first R_i <- R_i - mean_{j in group(i)} R_j, then the
    same whitening across the whole batch. Means and stds run over valid trajectories only.

    Each trajectory counts once in the batch statistics. With a KL penalty folded into token rewards
    (`losses.kl_in_reward`), the paper's token-level form is `gae(rewards_BT, 0, mask_BT, gamma=1, lam=1)`
    (the return to go) followed by `masked_whiten(adv_BT, mask_BT)`, which weights each token once.
    """
    valid = _valid_or_all(rewards_B, valid_B)
    returns = rewards_B.float().clone()
    if group_ids_B is not None:
        for g in group_ids_B.unique():
            members = (group_ids_B == g) & valid
            if members.any():
                returns[members] -= returns[members].mean()
    return _whiten(returns, valid, scale_by_std=True, eps=eps)


def masked_whiten(x_BT: Tensor, mask_BT: Tensor, *, eps: float = 1e-6) -> Tensor:
    """(x - mean) / (std + eps) over the positions where mask_BT == 1; 0 elsewhere. Returns x_BT's shape."""
    m = mask_BT.bool()
    return _whiten(x_BT.float().flatten(), m.flatten(), scale_by_std=True, eps=eps).view_as(x_BT)


def distillation_advantages(student_logp_BT: Tensor, teacher_logp_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """On-policy distillation's per-token advantage (Agarwal et al. 2024, GKD; Thinking Machines' "On-Policy
    Distillation", 2025): the student samples, the teacher scores the student's own tokens, and each sampled token's
    advantage is the negative of its reverse-KL estimate,

        A_t = -(log pi_student(x_t | x_<t) - log pi_teacher(x_t | x_<t)) = log pi_teacher - log pi_student,

    so the policy gradient lowers KL(student || teacher) over the student's own distribution. 0 off the mask (the
    env's tokens are neither the student's nor scored)."""
    return (teacher_logp_BT - student_logp_BT) * mask_BT


def gae(rewards_BT: Tensor, values_BT: Tensor, mask_BT: Tensor, *, gamma: float = 1.0,
        lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) over loss-masked positions only.

    The steps of the recursion are the positions with mask 1, in order; observation and prompt positions
    (mask 0) are skipped, so the "next step" of a sampled token is the next sampled token, even across a
    tool observation:

        delta_t = r_t + gamma * V_next(t) - V_t,     A_t = delta_t + gamma * lam * A_next(t)

    where next(t) is the next masked position (V and A are 0 after the last one: the episode ended).
    Returns (advantages_BT, returns_BT = advantages + values), both 0 at mask-0 positions.
    `values_BT` may be a plain 0 tensor (REINFORCE's return to go). Rewards at mask-0 positions would be
    dropped by this recursion, so they are an error: place them with `turn_rewards_to_tokens`.
    """
    m = mask_BT.bool()
    rewards = rewards_BT.float()
    values = torch.broadcast_to(values_BT, rewards.shape).float().detach()
    if torch.any(rewards[~m] != 0):
        raise ValueError("gae: nonzero rewards at mask-0 positions would be ignored; put each turn's reward on "
                         "its last sampled token (turn_rewards_to_tokens)")
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a_t = delta + gamma * lam * next_adv
        here = m[:, t]
        adv[:, t] = torch.where(here, a_t, 0.0)
        # Skipped positions carry the next step's value and advantage through unchanged.
        next_value = torch.where(here, values[:, t], next_value)
        next_adv = torch.where(here, a_t, next_adv)
    returns = torch.where(m, adv + values, 0.0)
    return adv, returns


def _spans_to_tokens(per_turn: Sequence[Sequence[float]], spans: Sequence[Sequence[tuple[int, int]]],
                     T: int, *, last_token_only: bool) -> Tensor:
    if len(per_turn) != len(spans):
        raise ValueError(f"{len(per_turn)} trajectories of values but {len(spans)} of turn spans")
    out = torch.zeros(len(per_turn), T)
    for b, (values, turn_spans) in enumerate(zip(per_turn, spans)):
        if len(values) != len(turn_spans):
            raise ValueError(f"trajectory {b}: {len(values)} turn values but {len(turn_spans)} turns")
        for value, (start, end) in zip(values, turn_spans):
            if not 0 <= start < end <= T:
                raise ValueError(f"trajectory {b}: turn span [{start}, {end}) is empty or outside [0, {T})")
            if last_token_only:
                out[b, end - 1] = value
            else:
                out[b, start:end] = value
    return out


def turn_rewards_to_tokens(turn_ends: Sequence[Sequence[int]], turn_rewards: Sequence[Sequence[float]],
                           T: int) -> Tensor:
    """Places each turn's reward on the last sampled token of that turn: position `Turn.end - 1` (ends are
    exclusive). `turn_ends[b][k]` and `turn_rewards[b][k]` belong to turn k of trajectory b. Returns rewards_BT,
    0 elsewhere; feed it to `gae` for per-turn credit with a critic (or with values 0, the return to go).
    """
    spans = [[(end - 1, end) for end in ends] for ends in turn_ends]
    return _spans_to_tokens(turn_rewards, spans, T, last_token_only=True)


def turn_level_group_advantages(turn_rewards: Sequence[Sequence[float]],
                                turn_spans: Sequence[Sequence[tuple[int, int]]], T: int,
                                valid_G: Tensor | None = None, *, return_to_go: bool = True, gamma: float = 1.0,
                                scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Per-turn credit with turn-level group baselines, across the G trajectories of one task.

    `turn_rewards[g][k]` is the reward of turn k of trajectory g (`Turn.reward`); `turn_spans[g][k]` is that
    turn's sampled span (`Turn.start`, `Turn.end`). Trajectories may have different numbers of turns.

    1. Per trajectory, the value of turn k is its return to go G_k = sum_{j >= k} gamma^(j-k) r_j
       (`return_to_go=False`: the turn's own reward r_k).
    2. Per turn index k, G_k is normalized like GRPO across the valid trajectories that have a turn k:
       A_{g,k} = (G_{g,k} - mean_g G_{.,k}) / (std_g G_{.,k} + eps)  (no std with `scale_by_std=False`).
       A turn index that only one trajectory reached has no baseline: its advantage is 0.
    3. Every sampled token of turn k gets A_{g,k}. Returns adv_GT (0 outside the turns' sampled spans and
       for invalid trajectories).
    """
    G = len(turn_rewards)
    valid = _valid_or_all(torch.zeros(G), valid_G)
    K = max((len(r) for r in turn_rewards), default=0)
    values_GK = torch.zeros(G, K)
    present_GK = torch.zeros(G, K, dtype=torch.bool)
    for g, rewards in enumerate(turn_rewards):
        running = 0.0
        for k in reversed(range(len(rewards))):
            running = rewards[k] + gamma * running if return_to_go else rewards[k]
            values_GK[g, k] = running
        present_GK[g, : len(rewards)] = True
    adv_GK = torch.zeros(G, K)
    for k in range(K):
        adv_GK[:, k] = grpo_advantages(values_GK[:, k], present_GK[:, k] & valid, scale_by_std=scale_by_std,
                                       eps=eps)
    per_turn = [adv_GK[g, : len(turn_rewards[g])].tolist() for g in range(G)]
    return _spans_to_tokens(per_turn, turn_spans, T, last_token_only=False)


# --- registry --------------------------------------------------------------------------------------------
# Every entry has one signature, so the loops can pick an estimator by name:
#     fn(rewards_B, valid_B=None, group_ids_B=None) -> adv_B
# group_ids_B holds each trajectory's group (Trajectory.group); None means that the input is one group. The
# per-group estimators run group by group; REINFORCE++ whitens across all of the input, so give it the
# whole batch (called on one group at a time it would be a per-group whitening, i.e. GRPO).

AdvantageFn = Callable[..., Tensor]


def _per_group(estimator: Callable[..., Tensor], rewards_B: Tensor, valid_B: Tensor | None = None,
               group_ids_B: Tensor | None = None) -> Tensor:
    if group_ids_B is None:
        return estimator(rewards_B, valid_B)
    valid = _valid_or_all(rewards_B, valid_B)
    out = torch.zeros_like(rewards_B, dtype=torch.float32)
    for g in group_ids_B.unique():
        members = group_ids_B == g
        out[members] = estimator(rewards_B[members], valid[members])
    return out


def _reinforce_pp(rewards_B: Tensor, valid_B: Tensor | None = None, group_ids_B: Tensor | None = None) -> Tensor:
    return reinforce_pp_advantages(rewards_B, valid_B)  # a global baseline only: groups play no part


def _reinforce_pp_baseline(rewards_B: Tensor, valid_B: Tensor | None = None,
                           group_ids_B: Tensor | None = None) -> Tensor:
    if group_ids_B is None:
        group_ids_B = torch.zeros(rewards_B.shape, dtype=torch.long, device=rewards_B.device)
    return reinforce_pp_advantages(rewards_B, valid_B, group_ids_B=group_ids_B)


ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": partial(_per_group, grpo_advantages),
    "dr_grpo": partial(_per_group, partial(grpo_advantages, scale_by_std=False)),
    "rloo": partial(_per_group, rloo_advantages),
    "reinforce_pp": _reinforce_pp,
    "reinforce_pp_baseline": _reinforce_pp_baseline,
}
