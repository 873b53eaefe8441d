"""Losses against numbers worked out by hand (in the comments), and proof that mask-0 positions contribute
nothing: not to the loss, not to the gradient."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from agentrl.trainers import (
    AGG_MODES,
    POLICY_LOSSES,
    PolicyLossConfig,
    aggregate,
    clip_cov_loss,
    gspo_loss,
    kl_cov_loss,
    kl_estimate,
    kl_in_reward,
    kl_loss,
    masked_mean,
    ppo_clip_loss,
    value_loss,
)
from agentrl.trainers.losses import CorrectionConfig, mis_keep, mismatch_metrics, rollout_correction, tis_weights

T_ = torch.tensor
LN2, LN1_5, LN0_7 = math.log(2.0), math.log(1.5), math.log(0.7)


def close(actual, expected, atol=1e-5):
    assert_close(actual, T_(expected, dtype=actual.dtype), atol=atol, rtol=0)


def logp_of_ratios(ratios):
    """logp for old_logp = 0 and these importance ratios, with gradients."""
    return torch.log(T_([ratios])).requires_grad_()


# --- aggregation -----------------------------------------------------------------------------------------

LOSS_2x3 = T_([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK_2x3 = T_([[1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize("mode, norm_const, expected", [
    ("token-mean", None, 7 / 3),                   # (1 + 2 + 4) / 3 tokens
    ("seq-mean-token-mean", None, 2.75),           # ((1 + 2)/2 + 4/1) / 2
    ("seq-mean-token-sum", None, 3.5),             # ((1 + 2) + 4) / 2
    ("seq-mean-token-sum-norm", 3.0, 7 / 6),       # ((1 + 2)/3 + 4/3) / 2
])
def test_aggregation_modes(mode, norm_const, expected):
    assert aggregate(LOSS_2x3, MASK_2x3, mode, norm_const=norm_const).item() == pytest.approx(expected)
    # An all-masked row (padding, an excluded trajectory) changes nothing.
    padded = aggregate(torch.cat([LOSS_2x3, T_([[9.0, 9.0, 9.0]])]), torch.cat([MASK_2x3, T_([[0, 0, 0]])]), mode,
                       norm_const=norm_const)
    assert padded.item() == pytest.approx(expected)


def test_aggregation_errors_say_what_is_allowed():
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        aggregate(LOSS_2x3, MASK_2x3, "mean")
    with pytest.raises(ValueError, match="norm_const"):
        aggregate(LOSS_2x3, MASK_2x3, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="norm_const"):
        aggregate(LOSS_2x3, MASK_2x3, "token-mean", norm_const=3.0)
    assert masked_mean(T_([[1.0, 100.0], [3.0, 5.0]]), T_([[1, 0], [1, 1]])).item() == pytest.approx(3.0)


def test_config_validation():
    for bad in (dict(dual_clip=1.0), dict(agg="mean"), dict(agg="seq-mean-token-sum-norm"), dict(norm_const=4.0),
                dict(clip_low=1.0), dict(clip_cov_lb=5.0, clip_cov_ub=1.0), dict(kl_cov_ratio=0.0)):
        with pytest.raises(ValueError, match="invalid PolicyLossConfig"):
            PolicyLossConfig(**bad)


# --- PPO -------------------------------------------------------------------------------------------------

def test_ppo_clip_by_hand():
    # clip 0.2, ratios r and advantages A per token; l = max(-A r, -A clip(r, 0.8, 1.2)):
    #   r 1.5, A +1: max(-1.5, -1.2) = -1.2   clipped  (no gradient)
    #   r 0.5, A +1: max(-0.5, -0.8) = -0.5   unclipped: d/dlogp = -A r / 4 = -0.125
    #   r 1.5, A -1: max( 1.5,  1.2) =  1.5   unclipped: d/dlogp = 1.5 / 4 = 0.375
    #   r 0.7, A -1: max( 0.7,  0.8) =  0.8   clipped  (no gradient)
    # token mean = (-1.2 - 0.5 + 1.5 + 0.8) / 4 = 0.15
    logp = logp_of_ratios([1.5, 0.5, 1.5, 0.7])
    loss, m = ppo_clip_loss(logp, torch.zeros(1, 4), T_([[1.0, 1.0, -1.0, -1.0]]), torch.ones(1, 4), PolicyLossConfig())
    assert loss.item() == pytest.approx(0.15)
    loss.backward()
    close(logp.grad, [[0.0, -0.125, 0.375, 0.0]])
    assert m["clip_frac"] == pytest.approx(0.5)
    assert m["ratio_mean"] == pytest.approx(1.05)  # 4.2 / 4
    assert m["ratio_max"] == pytest.approx(1.5)
    # approx_kl = mean of r - 1 - ln r: 0.5 - 0.405465, -0.5 + 0.693147, again 0.094535, -0.3 + 0.356675
    assert m["approx_kl"] == pytest.approx((2 * (0.5 - LN1_5) + (-0.5 + LN2) + (-0.3 - LN0_7)) / 4, abs=1e-6)


def test_clip_higher_is_asymmetric():
    # ratios [1.25, 1.5, 0.75], A [+1, +1, -1]
    # clip 0.2/0.28: -1.25 (inside [0.8, 1.28]), -1.28 (clipped above), max(0.75, 0.8) = 0.8 (clipped below)
    #   -> (-1.25 - 1.28 + 0.8) / 3 = -0.57667
    # clip 0.2/0.2:  -1.2, -1.2, 0.8 -> -0.53333
    adv, mask = T_([[1.0, 1.0, -1.0]]), torch.ones(1, 3)
    loss, m = ppo_clip_loss(logp_of_ratios([1.25, 1.5, 0.75]), torch.zeros(1, 3), adv, mask,
                            PolicyLossConfig(clip_low=0.2, clip_high=0.28))
    assert loss.item() == pytest.approx(-1.73 / 3)
    assert m["clip_frac"] == pytest.approx(2 / 3)
    loss, m = ppo_clip_loss(logp_of_ratios([1.25, 1.5, 0.75]), torch.zeros(1, 3), adv, mask, PolicyLossConfig())
    assert loss.item() == pytest.approx(-1.6 / 3)
    assert m["clip_frac"] == pytest.approx(1.0)


def test_dual_clip_caps_negative_advantages():
    # dual_clip c = 3; ratios [5, 2, 5], A [-1, -1, +1]:
    #   r 5, A -1: max(5, 1.2) = 5, capped at -A c = 3   (no gradient)
    #   r 2, A -1: max(2, 1.2) = 2 < 3                    d/dlogp = 2 / 3
    #   r 5, A +1: max(-5, -1.2) = -1.2 (the cap is for A < 0 only; no gradient)
    # mean (3 + 2 - 1.2) / 3 = 1.26667; without the dual clip (5 + 2 - 1.2) / 3 = 1.93333
    logp = logp_of_ratios([5.0, 2.0, 5.0])
    args = (torch.zeros(1, 3), T_([[-1.0, -1.0, 1.0]]), torch.ones(1, 3))
    loss, m = ppo_clip_loss(logp, *args, PolicyLossConfig(dual_clip=3.0))
    assert loss.item() == pytest.approx(3.8 / 3)
    loss.backward()
    close(logp.grad, [[0.0, 2 / 3, 0.0]])
    assert m["dual_clip_frac"] == pytest.approx(1 / 3)
    assert m["clip_frac"] == pytest.approx(1 / 3)
    loss, _ = ppo_clip_loss(logp_of_ratios([5.0, 2.0, 5.0]), *args, PolicyLossConfig())
    assert loss.item() == pytest.approx(5.8 / 3)


# --- GSPO, Clip-Cov, KL-Cov ------------------------------------------------------------------------------

def test_gspo_uses_one_clipped_ratio_per_sequence():
    # seq 0: log ratios [ln 2, 0] (third token masked) -> s0 = exp(ln2 / 2) = 1.41421, A = +1: clipped -> -1.2
    # seq 1: log ratios [0.3, -0.3, 0.06] -> s1 = exp(0.02) = 1.02020 (inside), A = -1 -> +1.02020
    #   (token by token, PPO would clip the first token of seq 1 instead: e^0.3 = 1.35)
    # seq-mean-token-mean: (-1.2 + 1.02020) / 2 = -0.08990
    # gradient: seq 0 none (clipped); seq 1 d/dlogp_t [(-A s1) / 2] = s1 / 3 / 2 = 0.17003 for each token
    logp = T_([[LN2, 0.0, 1e4], [0.3, -0.3, 0.06]], requires_grad=True)
    adv = T_([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = T_([[1, 1, 0], [1, 1, 1]])
    cfg = PolicyLossConfig(agg="seq-mean-token-mean")
    loss, m = gspo_loss(logp, torch.zeros(2, 3), adv, mask, cfg)
    s1 = math.exp(0.02)
    assert loss.item() == pytest.approx((-1.2 + s1) / 2)
    loss.backward()
    close(logp.grad, [[0.0, 0.0, 0.0], [s1 / 6, s1 / 6, s1 / 6]])
    assert m["ratio_max"] == pytest.approx(math.sqrt(2))
    assert m["clip_frac"] == pytest.approx(2 / 5)  # seq 0's two tokens of five
    with pytest.raises(ValueError, match="dual_clip"):
        gspo_loss(logp, torch.zeros(2, 3), adv, mask, PolicyLossConfig(dual_clip=3.0))


COV_LOGP = [[-1.0, -2.0, -3.0, -2.0]]
COV_ADV = [[3.0, 0.0, -1.0, -2.0]]
# mean A = 0, mean logp = -2 -> Cov = A * (logp + 2) = [3 * 1, 0, -1 * -1, 0] = [3, 0, 1, 0]


def test_clip_cov_detaches_high_covariance_tokens():
    # Ratios 1, nothing clipped; per token -A = [-3, 0, 1, 2], mean 0. Band (1, 5): token 0 only (1 is not > 1).
    # N = 4 -> max(1, int(2e-4 * 4)) = 1 token detached. PPO gradient -A / 4 = [-0.75, 0, 0.25, 0.5].
    logp = T_(COV_LOGP, requires_grad=True)
    loss, m = clip_cov_loss(logp, logp.detach(), T_(COV_ADV), torch.ones(1, 4), PolicyLossConfig())
    assert loss.item() == pytest.approx(0.0)
    loss.backward()
    close(logp.grad, [[0.0, 0.0, 0.25, 0.5]])
    assert m["cov_detach_frac"] == pytest.approx(0.25)
    # Token 0 already clipped by PPO (ratio 1.5, A > 0) is not a candidate: nothing more is detached.
    logp = T_(COV_LOGP, requires_grad=True)
    old = logp.detach() - T_([[LN1_5, 0.0, 0.0, 0.0]])
    loss, m = clip_cov_loss(logp, old, T_(COV_ADV), torch.ones(1, 4), PolicyLossConfig())
    loss.backward()
    close(logp.grad, [[0.0, 0.0, 0.25, 0.5]])
    assert m["cov_detach_frac"] == 0.0


def test_kl_cov_penalizes_the_top_covariance_tokens():
    # k = max(1, int(2e-3 * 4)) = 1 token: the largest Cov, token 0. Its log ratio is 0.1, r = e^0.1 = 1.10517.
    # per token: -A r = [-3.31551, 0, 1, 2] + beta |0.1| on token 0 -> [-3.21551, 0, 1, 2], mean -0.05388
    # gradient: token 0 (-A r + beta * sign(0.1)) / 4 = (-3.31551 + 1) / 4 = -0.57888; others -A / 4
    logp = T_(COV_LOGP, requires_grad=True)
    old = logp.detach() - T_([[0.1, 0.0, 0.0, 0.0]])
    loss, m = kl_cov_loss(logp, old, T_(COV_ADV), torch.ones(1, 4), PolicyLossConfig(kl_cov_coef=1.0))
    r = math.exp(0.1)
    assert loss.item() == pytest.approx((-3 * r + 0.1 + 1 + 2) / 4)
    loss.backward()
    close(logp.grad, [[(-3 * r + 1) / 4, 0.0, 0.25, 0.5]])
    assert m["kl_cov_frac"] == pytest.approx(0.25)
    assert m["clip_frac"] == 0.0


# --- KL, value, entropy ----------------------------------------------------------------------------------

def test_kl_estimators_by_hand():
    # pi = 0.5, ref = 0.25: log pi/ref = ln 2; r = ref/pi = 0.5
    #   k1 = ln 2 = 0.693147;  k2 = (ln 2)^2 / 2 = 0.240227;  k3 = 0.5 - 1 + ln 2 = 0.193147
    # pi = 0.25, ref = 0.5: r = 2 -> k1 = -0.693147, k2 = 0.240227, k3 = 2 - 1 - ln 2 = 0.306853
    logp, ref = torch.log(T_([[0.5, 0.25, 0.3]])), torch.log(T_([[0.25, 0.5, 0.3]]))
    close(kl_estimate(logp, ref, "k1"), [[LN2, -LN2, 0.0]])
    close(kl_estimate(logp, ref, "k2"), [[LN2 ** 2 / 2, LN2 ** 2 / 2, 0.0]])
    close(kl_estimate(logp, ref, "k3"), [[LN2 - 0.5, 1 - LN2, 0.0]])
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_estimate(logp, ref, "k4")


def test_k1_and_k3_are_unbiased_for_kl_pi_ref():
    # Over the whole support of pi = [0.5, 0.5] with ref = [0.25, 0.75]:
    # KL(pi || ref) = 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 * 0.693147 - 0.5 * 0.405465 = 0.143841
    pi, ref = T_([0.5, 0.5]), T_([0.25, 0.75])
    for kind in ("k1", "k3"):
        expectation = (pi * kl_estimate(pi.log(), ref.log(), kind)).sum()
        assert expectation.item() == pytest.approx(0.143841, abs=1e-6)


def test_kl_loss_and_kl_in_reward():
    # tokens 1 and 2 sampled: k1 = [ln 2, -ln 2] -> token mean 0; k3 = [0.193147, 0.306853] -> mean 0.25
    logp = T_([[9.0, math.log(0.5), math.log(0.25)]])
    ref = T_([[0.0, math.log(0.25), math.log(0.5)]])
    mask = T_([[0, 1, 1]])
    assert kl_loss(logp, ref, mask, "k1")[0].item() == pytest.approx(0.0, abs=1e-6)
    loss, m = kl_loss(logp, ref, mask, "k3", "seq-mean-token-sum")
    assert loss.item() == pytest.approx(0.5)  # one sequence, sum 0.193147 + 0.306853
    assert m["kl"] == pytest.approx(0.25)
    # beta 0.1, k1: r - 0.1 * [ln 2, -ln 2] on sampled tokens; the prompt position keeps its reward 0
    close(kl_in_reward(T_([[0.0, 0.0, 1.0]]), logp, ref, mask, beta=0.1), [[0.0, -0.1 * LN2, 1 + 0.1 * LN2]])


def test_value_loss_clipping_by_hand():
    # clip 0.2, old V = 0.5; V' = 0.5 + clip(V - 0.5, -0.2, 0.2)
    #   V 1.0, R 1: (1 - 1)^2 = 0,     V' 0.7: (0.7 - 1)^2 = 0.09 -> 0.09 (clipped, no gradient)
    #   V 0.6, R 0: 0.36,              V' 0.6: 0.36               -> 0.36, d/dV = 2 * 0.6 = 1.2
    #   V 0.0, R 1: 1,                 V' 0.3: 0.49               -> 1,    d/dV = 2 * (0 - 1) = -2
    # 0.5 * (0.09 + 0.36 + 1) / 3 = 0.24167; gradient 0.5 / 3 * [0, 1.2, -2] = [0, 0.2, -0.33333]
    values = T_([[1.0, 0.6, 0.0]], requires_grad=True)
    old, returns, mask = T_([[0.5, 0.5, 0.5]]), T_([[1.0, 0.0, 1.0]]), torch.ones(1, 3)
    loss, m = value_loss(values, old, returns, mask, clip=0.2)
    assert loss.item() == pytest.approx(0.5 * 1.45 / 3)
    loss.backward()
    close(values.grad, [[0.0, 0.2, -1 / 3]])
    assert m["value_clip_frac"] == pytest.approx(1 / 3)
    loss, _ = value_loss(values, old, returns, mask, clip=None)
    assert loss.item() == pytest.approx(0.5 * 1.36 / 3)  # 0.5 * (0 + 0.36 + 1) / 3


# --- the sampler/trainer correction: TIS, MIS, mismatch metrics ------------------------------------------

# Two sequences; p_trainer / p_sampler on the masked tokens: 0.6/0.4, 0.3/0.1, 0.1/0.4 | 0.5/0.5, 0.8/0.5,
# so the importance ratios are 1.5, 3, 0.25 | 1, 1.6 (products per sequence: 1.125 | 1.6). Mask-0: garbage.
NAN, INF = math.nan, math.inf
P_TRAINER = T_([[0.6, 0.3, 0.1, NAN], [0.5, 0.8, INF, 0.3]])
P_SAMPLER = T_([[0.4, 0.1, 0.4, 0.2], [0.5, 0.5, NAN, -INF]])
MASK_C = T_([[1, 1, 1, 0], [1, 1, 0, 0]])
TRAINER_LOGP, SAMPLER_LOGP = P_TRAINER.log(), P_SAMPLER.log()


def test_tis_token_and_sequence_by_hand():
    w, m = tis_weights(TRAINER_LOGP.clone().requires_grad_(), SAMPLER_LOGP, MASK_C, cap=2.0, level="token")
    close(w, [[1.5, 2.0, 0.25, 0.0], [1.0, 1.6, 0.0, 0.0]])  # 3 is capped at 2
    assert not w.requires_grad  # a constant of the loss
    assert m["tis_truncated_frac"] == pytest.approx(1 / 5) and m["tis_weight_mean"] == pytest.approx(6.35 / 5)
    w, m = tis_weights(TRAINER_LOGP, SAMPLER_LOGP, MASK_C, cap=2.0, level="sequence")
    close(w, [[1.125] * 3 + [0.0], [1.6, 1.6, 0.0, 0.0]])  # exp of the sum over the sequence's masked tokens
    assert m["tis_truncated_frac"] == 0.0 and m["tis_weight_mean"] == pytest.approx((3 * 1.125 + 2 * 1.6) / 5)
    w, m = tis_weights(TRAINER_LOGP, SAMPLER_LOGP, MASK_C, cap=1.5, level="sequence")
    close(w, [[1.125] * 3 + [0.0], [1.5, 1.5, 0.0, 0.0]])  # the second sequence's 1.6 is capped at 1.5
    assert m["tis_truncated_frac"] == pytest.approx(2 / 5)  # counted in tokens: its 2 of the 5


def test_mis_token_and_sequence_by_hand():
    keep, m = mis_keep(TRAINER_LOGP, SAMPLER_LOGP, MASK_C, threshold=2.0, level="token")
    close(keep, [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])  # 3 > 2 and 0.25 < 1/2 are rejected
    assert m["mis_masked_frac"] == pytest.approx(2 / 5)
    keep, m = mis_keep(TRAINER_LOGP, SAMPLER_LOGP, MASK_C, threshold=2.0, level="sequence")
    close(keep, MASK_C.tolist())  # 1.125 and 1.6 are both in [1/2, 2]
    assert m["mis_masked_frac"] == 0.0
    keep, m = mis_keep(TRAINER_LOGP, SAMPLER_LOGP, MASK_C, threshold=1.5, level="sequence")
    close(keep, [[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # 1.6 > 1.5: the whole second sequence goes
    assert m["mis_masked_frac"] == pytest.approx(2 / 5)


def test_mismatch_metrics_by_hand():
    m = mismatch_metrics(TRAINER_LOGP, SAMPLER_LOGP, MASK_C)
    log_ratios = [math.log(r) for r in (1.5, 3.0, 0.25, 1.0, 1.6)]
    assert m["mismatch_kl_k1"] == pytest.approx(-math.log(1.8) / 5, abs=1e-6)  # mean(sampler - trainer)
    assert m["mismatch_kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in log_ratios) / 5, abs=1e-6)
    assert m["mismatch_kl_k3"] == pytest.approx((2.35 - math.log(1.8)) / 5, abs=1e-6)
    assert m["mismatch_abs_dp"] == pytest.approx((0.2 + 0.2 + 0.3 + 0.0 + 0.3) / 5, abs=1e-6)
    # the weights sorted: 0.25, 1.0, 1.5, 1.6, 3.0; linear interpolation at 0.05 * 4 = 0.2 and 0.95 * 4 = 3.8
    assert m["is_weight_p05"] == pytest.approx(0.25 + 0.2 * 0.75, abs=1e-6)
    assert m["is_weight_p50"] == pytest.approx(1.5, abs=1e-6)
    assert m["is_weight_p95"] == pytest.approx(1.6 + 0.8 * 1.4, abs=1e-5)
    assert m["is_weight_max"] == pytest.approx(3.0, abs=1e-6)


def test_rollout_correction_folds_tis_into_adv_and_mis_into_mask():
    adv = T_([[1.0, -2.0, 3.0, 9.0], [0.5, 1.0, 9.0, 9.0]])
    cfg = CorrectionConfig(decoupled=True, tis="token", tis_cap=2.0, mis="token", mis_threshold=2.0)
    adv_c, mask_c, m = rollout_correction(TRAINER_LOGP, SAMPLER_LOGP, adv, MASK_C, cfg)
    close(mask_c, [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    close(adv_c, [[1.5, 0.0, 0.0, 0.0], [0.5, 1.6, 0.0, 0.0]])  # A * w on the kept tokens, 0 elsewhere
    assert m["tis_truncated_frac"] == pytest.approx(1 / 5) and m["mis_masked_frac"] == pytest.approx(2 / 5)
    assert m["mismatch_abs_dp"] == pytest.approx(0.2, abs=1e-6)  # over the tokens given, before MIS
    adv_c, mask_c, m = rollout_correction(TRAINER_LOGP, SAMPLER_LOGP, adv, MASK_C, CorrectionConfig(decoupled=True))
    close(adv_c, torch.where(MASK_C > 0, adv, 0.0).tolist())  # decoupled alone: only the metrics
    assert torch.equal(mask_c, MASK_C) and "tis_truncated_frac" not in m


def test_folding_the_weight_into_adv_weighs_each_ppo_token_loss():
    """l_t(wA) = w l_t(A) for the clipped loss, dual clip included. Ratios 1.5, 0.5, 1.1, 4; A = 1, -1, -2, -1;
    w = 2, 0.25, 1, 0.5; clip 0.2, dual clip 3. Unweighted l_t: max(-1.5, -1.2) = -1.2; max(0.5, 0.8) = 0.8;
    2.2; min(max(4, 1.2), 3) = 3. Weighted: -2.4, 0.2, 2.2, 1.5, token mean 1.5 / 4. Only token 2 is unclipped:
    d/dlogp (2 r) / 4 = 2.2 / 4."""
    logp = logp_of_ratios([1.5, 0.5, 1.1, 4.0])
    adv, w = T_([[1.0, -1.0, -2.0, -1.0]]), T_([[2.0, 0.25, 1.0, 0.5]])
    loss, _ = ppo_clip_loss(logp, torch.zeros(1, 4), adv * w, torch.ones(1, 4), PolicyLossConfig(dual_clip=3.0))
    close(loss, 1.5 / 4)
    loss.backward()
    close(logp.grad, [[0.0, 0.0, 0.55, 0.0]])


def test_correction_config_is_validated():
    with pytest.raises(ValueError, match="set decoupled = true"):
        CorrectionConfig(tis="token")
    with pytest.raises(ValueError, match="mis_threshold must be > 1"):
        CorrectionConfig(decoupled=True, mis="token", mis_threshold=1.0)
    with pytest.raises(ValueError, match="correction level"):
        tis_weights(TRAINER_LOGP, SAMPLER_LOGP, MASK_C, level="geometric")


# --- mask-0 positions contribute nothing -----------------------------------------------------------------

GARBAGE = [1e30, -1e30, math.inf, -math.inf, math.nan, 7.0]


def _assert_mask_zero_positions_are_inert(fn, garbage=GARBAGE):
    """fn(x, old, adv, mask) -> loss. Garbage (huge, inf, nan) at mask-0 positions of every input leaves the loss
    and the gradient wrt x bit-identical, and the gradient there is exactly 0."""
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(2, 6, generator=gen) * 2
    old = logp - 0.3 * torch.randn(2, 6, generator=gen)
    adv = torch.randn(2, 6, generator=gen) * 2
    mask = T_([[0, 1, 1, 0, 0, 1], [0, 0, 1, 1, 1, 0]])
    garbage = T_(garbage).repeat(2, 1)

    def run(x, o, a):
        x = x.clone().requires_grad_()
        torch.manual_seed(1)  # Clip-Cov draws its tokens at random
        loss = fn(x, o, a, mask)
        loss.backward()
        return loss.detach(), x.grad

    off = mask == 0
    loss_a, grad_a = run(logp, old, adv)
    loss_b, grad_b = run(torch.where(off, garbage, logp), torch.where(off, -garbage, old),
                         torch.where(off, garbage.flip(-1), adv))
    assert torch.isfinite(loss_a) and torch.equal(loss_a, loss_b)
    assert torch.equal(grad_a, grad_b)
    assert torch.all(grad_b[off] == 0)
    assert grad_a[~off].abs().sum() > 0  # the test has something to protect


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES) + ["ppo_dual_clip"])
def test_masked_positions_are_inert_in_policy_losses(name, agg):
    norm = 4.0 if agg == "seq-mean-token-sum-norm" else None
    dual = 3.0 if name == "ppo_dual_clip" else None
    cfg = PolicyLossConfig(clip_high=0.28, dual_clip=dual, agg=agg, norm_const=norm)
    loss_fn = POLICY_LOSSES[name.removesuffix("_dual_clip")]
    _assert_mask_zero_positions_are_inert(lambda lp, old, adv, mask: loss_fn(lp, old, adv, mask, cfg)[0])


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_masked_positions_are_inert_in_kl_loss(kind):
    _assert_mask_zero_positions_are_inert(lambda lp, ref, _, mask: kl_loss(lp, ref, mask, kind)[0])


def test_masked_positions_are_inert_in_value_loss():
    _assert_mask_zero_positions_are_inert(lambda v, old, ret, mask: value_loss(v, old, ret, mask)[0])


def test_masked_positions_are_inert_under_the_correction():
    """The sampler's logprobs are old + 0.1 A (garbage where old is), the weights and mask from them."""
    cfg = CorrectionConfig(decoupled=True, tis="token", mis="token")

    def corrected_loss(lp, old, adv, mask):
        adv_c, mask_c, _ = rollout_correction(old, old + 0.1 * adv, adv, mask, cfg)
        return ppo_clip_loss(lp, old, adv_c, mask_c, PolicyLossConfig())[0]

    _assert_mask_zero_positions_are_inert(corrected_loss)


# --- cases that mutation testing found unguarded (docs/mutation.md) ----------------------------------------

def test_micro_batch_weights_make_accumulation_exact():
    # minibatch rows: 2 tokens, none, 1 token. Micro-batches rows {0} and {1, 2}.
    # token-mean: 2/3 and 1/3 of the tokens; seq-mean modes: 1/2 and 1/2 of the rows that have tokens
    from agentrl.trainers.losses import micro_batch_weight

    mask = T_([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    loss = T_([[1.0, 2.0, 9.0], [9.0, 9.0, 9.0], [4.0, 9.0, 9.0]])
    assert micro_batch_weight(mask[:1], mask, "token-mean") == 2 / 3
    assert micro_batch_weight(mask[1:], mask, "token-mean") == 1 / 3
    assert micro_batch_weight(mask[1:], mask, "seq-mean-token-mean") == 0.5
    for mode in AGG_MODES:
        norm = 3.0 if mode == "seq-mean-token-sum-norm" else None
        parts = sum(micro_batch_weight(mask[s], mask, mode) * aggregate(loss[s], mask[s], mode, norm_const=norm)
                    for s in (slice(0, 1), slice(1, 3)))
        assert parts.item() == pytest.approx(aggregate(loss, mask, mode, norm_const=norm).item(), rel=1e-6)
    # one token in the whole minibatch: weight 1; no tokens at all: 0
    one = T_([[0.0, 1.0]])
    assert micro_batch_weight(one, one, "token-mean") == 1.0 and micro_batch_weight(one, one, "seq-mean-token-sum") == 1.0
    assert micro_batch_weight(torch.zeros(1, 2), torch.zeros(2, 2), "token-mean") == 0.0


def test_masked_mean_of_one_token():
    assert masked_mean(T_([[3.0, 5.0]]), T_([[0, 1]])).item() == 5.0


def test_value_loss_default_clip_lower_side_and_metrics():
    # default clip 0.2, old V 0: V -1 -> V' = -0.2; R -2: unclipped (-1 + 2)^2 = 1, clipped (-0.2 + 2)^2 = 3.24
    # -> 0.5 * 3.24 = 1.62. V 0.1 (inside the clip), R 0: 0.01 both ways
    values, old, returns = T_([[-1.0, 0.1]]), T_([[0.0, 0.0]]), T_([[-2.0, 0.0]])
    loss, metrics = value_loss(values, old, returns, T_([[1, 0]]))
    assert loss.item() == pytest.approx(1.62)
    assert metrics == pytest.approx({"value_clip_frac": 1.0, "value_mean": -1.0, "value_mse": 1.0})
    # seq-mean-token-sum-norm with norm_const 2: 0.5 * (3.24 + 0.01) / 2 / 1 row
    loss, _ = value_loss(values, old, returns, T_([[1, 1]]), agg="seq-mean-token-sum-norm", norm_const=2.0)
    assert loss.item() == pytest.approx(0.5 * 3.25 / 2)


def test_correction_config_lists_every_problem():
    with pytest.raises(ValueError) as raised:
        CorrectionConfig(decoupled=True, tis="token", tis_cap=0.0, mis_threshold=1.0)
    assert str(raised.value) == ("invalid CorrectionConfig: tis_cap must be > 0 (e.g. 2.0), got 0.0; "
                                 "mis_threshold must be > 1 (the kept weights are [1/C, C]), got 1.0")
    assert CorrectionConfig(decoupled=True, tis="sequence", tis_cap=0.5).tis_cap == 0.5  # a cap below 1 is allowed


@pytest.mark.parametrize("ratio, detached", [
    (2e-4, [0.25]),  # max(1, int(2e-4 * 4)) = 1 of the 2 candidates, drawn at random
    (0.5, [0.5]),    # int(0.5 * 4) = 2: both candidates
    (1.0, [0.5]),    # 4 asked for, but only the 2 candidates can be detached
])
def test_clip_cov_detaches_a_fraction_of_the_candidates(ratio, detached):
    # A = [2, 2, -2, -2] (mean 0), logp = -3 + [1.5, 2.5, -2.5, -1.5] (mean -3): Cov = [3, 5, 5, 3]. Band (1, 5):
    # tokens 0 and 3 (5 is not < 5). Ratios 1: loss mean(-A) = 0, gradient -A / 4 = [-0.5, -0.5, 0.5, 0.5].
    logp = T_([[-1.5, -0.5, -5.5, -4.5]], requires_grad=True)
    loss, m = clip_cov_loss(logp, logp.detach(), T_([[2.0, 2.0, -2.0, -2.0]]), torch.ones(1, 4),
                            PolicyLossConfig(clip_cov_ratio=ratio))
    assert loss.item() == 0.0 and [m["cov_detach_frac"]] == detached
    loss.backward()
    g = logp.grad[0].tolist()
    assert g[1:3] == [-0.5, 0.5]  # never candidates
    assert g[0] in (-0.5, 0.0) and g[3] in (0.0, 0.5) and (g[0] == 0.0) + (g[3] == 0.0) == detached[0] * 4


def test_kl_loss_metrics_and_norm_const():
    # k1 on the two sampled tokens: logp - ref = [-1 + 1.5, -2 + 1] = [0.5, -1]: mean -0.25, max 0.5
    logp, ref, mask = T_([[-1.0, -2.0, 5.0]]), T_([[-1.5, -1.0, 0.0]]), T_([[1, 1, 0]])
    loss, metrics = kl_loss(logp, ref, mask, "k1", "seq-mean-token-sum-norm", norm_const=4.0)
    assert loss.item() == -0.125 and metrics == {"kl": -0.25, "kl_max": 0.5}  # (0.5 - 1) / 4
    loss, metrics = kl_loss(logp, ref, torch.zeros(1, 3), "k1")  # no sampled tokens
    assert loss.item() == 0.0 and metrics == {"kl": 0.0, "kl_max": 0.0}


def test_gspo_ratio_against_nonzero_old_logprobs():
    # seq 0, one sampled token: log ratio -1 - (-1.1) = 0.1 -> s0 = e^0.1 = 1.10517 (inside [0.8, 1.2]), A = +1
    # seq 1: log ratios [-2 + 1.9, -0.5 + 0.7] = [-0.1, 0.2], mean 0.05 -> s1 = e^0.05 = 1.05127, A = -1
    # seq-mean-token-mean: (-1.10517 + 1.05127) / 2
    logp = T_([[-1.0, 7.0], [-2.0, -0.5]], requires_grad=True)
    old = T_([[-1.1, -9.0], [-1.9, -0.7]])
    loss, m = gspo_loss(logp, old, T_([[1.0, 1.0], [-1.0, -1.0]]), T_([[1, 0], [1, 1]]),
                        PolicyLossConfig(agg="seq-mean-token-mean"))
    assert loss.item() == pytest.approx((-math.exp(0.1) + math.exp(0.05)) / 2, abs=1e-6)  # -0.02695
    assert m["ratio_max"] == pytest.approx(math.exp(0.1), rel=1e-6)
    with pytest.raises(ValueError, match=r"^gspo_loss clips the sequence ratio only; set dual_clip=None$"):
        gspo_loss(logp, old, T_([[1.0, 1.0], [-1.0, -1.0]]), T_([[1, 0], [1, 1]]), PolicyLossConfig(dual_clip=3.0))


def test_dpo_loss_with_default_beta_and_unequal_masks():
    # Three (chosen, rejected) pairs, ref 0, each row its own mask (NaN where it is 0). Sequence sums s:
    # pair 1: 0.5 + 0.5 = 1 vs -1 -> margin 2; pair 2: 0 + 0.5 + 0.5 = 1 vs 0.5 + 0.5 = 1 -> 0; pair 3: -1 vs 0 -> -1.
    # beta 0.1: z = [0.2, 0, -0.1]; loss = mean(-log sigmoid(z)) = (softplus(-0.2) + ln 2 + softplus(0.1)) / 3
    from agentrl.trainers.losses import dpo_loss

    logp = T_([[0.5, 0.5, NAN], [-1.0, NAN, NAN], [0.0, 0.5, 0.5], [NAN, 0.5, 0.5], [-1.0, NAN, NAN], [0.0, 0.0, 0.0]])
    mask = T_([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1], [1, 0, 0], [1, 1, 1]])
    ref = torch.where(mask.bool(), 0.0, NAN)
    loss, metrics = dpo_loss(logp, ref, mask)
    softplus = lambda x: math.log1p(math.exp(x))  # noqa: E731
    assert loss.item() == pytest.approx((softplus(-0.2) + LN2 + softplus(0.1)) / 3, abs=1e-6)
    assert metrics == pytest.approx({"reward_accuracy": 1 / 3, "reward_margin": 1 / 3})
    with pytest.raises(ValueError, match=r"^DPO needs \(chosen, rejected\) row pairs; got 3 rows$"):
        dpo_loss(logp[:3, :2], ref[:3, :2], mask[:3, :2])


def test_kl_cov_penalizes_a_fraction_of_the_tokens_and_refuses_dual_clip():
    # Cov = [3, 5, 5, 3] as in test_clip_cov_detaches_a_fraction_of_the_candidates: ratio 0.5 of 4 tokens -> the
    # top 2 (tokens 1 and 2). Ratios 1: loss mean(-A) = 0, and every |log ratio| is 0.
    logp = T_([[-1.5, -0.5, -5.5, -4.5]])
    adv = T_([[2.0, 2.0, -2.0, -2.0]])
    loss, m = kl_cov_loss(logp, logp, adv, torch.ones(1, 4), PolicyLossConfig(kl_cov_ratio=0.5))
    assert loss.item() == 0.0 and m["kl_cov_frac"] == 0.5
    with pytest.raises(ValueError, match=r"^kl_cov_loss does not clip \(the covariance penalty replaces clipping\); "
                                         r"set dual_clip=None$"):
        kl_cov_loss(logp, logp, adv, torch.ones(1, 4), PolicyLossConfig(dual_clip=3.0))


def test_ppo_ratio_against_nonzero_old_logprobs():
    # log ratios -1 - (-1.1) = 0.1 and -2 - (-1.5) = -0.5: r = [1.10517, 0.60653]; A = [1, -1], clip 0.2.
    # token 0: max(-1.10517, -1.10517) (inside the clip); token 1: max(0.60653, clip(0.60653) = 0.8) = 0.8 (clipped)
    loss, m = ppo_clip_loss(T_([[-1.0, -2.0]]), T_([[-1.1, -1.5]]), T_([[1.0, -1.0]]), torch.ones(1, 2),
                            PolicyLossConfig())
    assert loss.item() == pytest.approx((-math.exp(0.1) + 0.8) / 2, abs=1e-6)
    assert m["clip_frac"] == 0.5 and m["ratio_min"] == pytest.approx(math.exp(-0.5), rel=1e-6)


def test_dual_clip_boundaries():
    # c = 2. A = -1, r = 2: max(2, 1.2) = 2 equals the cap -A c = 2, so the cap is not active (the gradient r / 2 = 1
    # flows, dual_clip_frac 0). A = +0.5, r = 1: -0.5, never capped (the cap is for A < 0). Loss (2 - 0.5) / 2.
    logp = T_([[math.log(2.0), 0.0]], requires_grad=True)
    loss, m = ppo_clip_loss(logp, torch.zeros(1, 2), T_([[-1.0, 0.5]]), torch.ones(1, 2), PolicyLossConfig(dual_clip=2.0))
    assert loss.item() == pytest.approx(0.75)
    loss.backward()
    close(logp.grad, [[1.0, -0.25]])
    assert m["dual_clip_frac"] == 0.0


def test_policy_loss_config_boundaries_and_message():
    for valid in (dict(clip_low=0.0, clip_high=0.0, dual_clip=1.5, kl_cov_ratio=1.0, kl_cov_coef=0.0),
                  dict(agg="seq-mean-token-sum-norm", norm_const=0.5, kl_cov_coef=0.5, clip_cov_ratio=1.0)):
        PolicyLossConfig(**valid)
    for invalid in (dict(clip_high=-0.1), dict(agg="seq-mean-token-sum-norm", norm_const=0.0), dict(clip_cov_ratio=0.0),
                    dict(clip_cov_ratio=1.5), dict(clip_cov_lb=5.0), dict(kl_cov_coef=-1.0)):
        with pytest.raises(ValueError, match="^invalid PolicyLossConfig: "):
            PolicyLossConfig(**invalid)
    with pytest.raises(ValueError) as raised:
        PolicyLossConfig(clip_low=1.0, clip_high=-0.1, dual_clip=1.0, agg="sum", norm_const=-1.0, clip_cov_ratio=0.0,
                         clip_cov_lb=5.0, kl_cov_coef=-1.0)
    assert str(raised.value) == (
        "invalid PolicyLossConfig: clip_low must be in [0, 1), got 1.0; clip_high must be >= 0, got -0.1; "
        "dual_clip must be > 1 (e.g. 3.0) or None, got 1.0; agg must be one of token-mean, seq-mean-token-mean, "
        "seq-mean-token-sum, seq-mean-token-sum-norm, got 'sum'; norm_const must be set exactly when agg is "
        "'seq-mean-token-sum-norm'; norm_const must be > 0, got -1.0; clip_cov_ratio and kl_cov_ratio must be in "
        "(0, 1]; clip_cov_lb (5.0) must be < clip_cov_ub (5.0); kl_cov_coef must be >= 0, got -1.0")
    with pytest.raises(ValueError, match=r"^unknown aggregation mode 'mean'; modes: token-mean, seq-mean-token-mean, "
                                         r"seq-mean-token-sum, seq-mean-token-sum-norm$"):
        aggregate(LOSS_2x3, MASK_2x3, "mean")


def test_shape_errors_name_both_shapes():
    logp, cfg = torch.zeros(1, 2), PolicyLossConfig()
    with pytest.raises(ValueError, match=r"^shape mismatch: \(1, 2\) vs \(1, 3\)$"):
        ppo_clip_loss(logp, torch.zeros(1, 3), torch.zeros(1, 2), torch.ones(1, 2), cfg)
    with pytest.raises(ValueError, match=r"^mask has shape \(1, 3\), inputs \(1, 2\)$"):
        ppo_clip_loss(logp, logp, logp, torch.ones(1, 3), cfg)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]$"):
        PolicyLossConfig(kl_cov_ratio=1.5)
