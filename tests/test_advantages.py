"""Advantage estimators against numbers worked out by hand (in the comments).

std is Bessel-corrected throughout (torch.std's default, the GRPO convention of DeepSeekMath, TRL and verl):
for [1, 0, 0, 1], mean 0.5, var = 4 * 0.25 / 3 = 1/3, std = 0.57735.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from agentrl.trainers import (
    ADVANTAGES,
    gae,
    grpo_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    rloo_advantages,
    turn_level_group_advantages,
    turn_rewards_to_tokens,
)

T_ = torch.tensor


def close(actual, expected, atol=1e-5):
    assert_close(actual, T_(expected, dtype=actual.dtype), atol=atol, rtol=0)


# --- group and batch estimators --------------------------------------------------------------------------

def test_grpo_normalizes_by_unbiased_std():
    # mean 0.5, deviations +-0.5, std 0.57735 -> +-0.5 / 0.57735 = +-0.86603
    close(grpo_advantages(T_([1.0, 0.0, 0.0, 1.0])), [0.86603, -0.86603, -0.86603, 0.86603])


def test_dr_grpo_only_centers():
    close(grpo_advantages(T_([1.0, 0.0, 0.0, 1.0]), scale_by_std=False), [0.5, -0.5, -0.5, 0.5])


def test_grpo_excludes_invalid_entries():
    # valid rewards [1, 0, 0]: mean 1/3, deviations [2/3, -1/3, -1/3], var = (4/9 + 1/9 + 1/9) / 2 = 1/3,
    # std 0.57735 -> [1.15470, -0.57735, -0.57735]; the error (reward 5, say) gets 0 and moves nothing.
    adv = grpo_advantages(T_([1.0, 0.0, 5.0, 0.0]), T_([True, True, False, True]))
    close(adv, [1.15470, -0.57735, 0.0, -0.57735])


def test_grpo_degenerate_groups_get_zero():
    close(grpo_advantages(T_([1.0, 1.0, 1.0])), [0.0, 0.0, 0.0])  # no spread: 0 / (0 + eps)
    close(grpo_advantages(T_([1.0, 0.0]), T_([True, False])), [0.0, 0.0])  # one valid member: no baseline
    close(grpo_advantages(T_([1.0, 0.0]), T_([False, False])), [0.0, 0.0])


def test_rloo_leaves_one_out():
    # 1 - (0 + 0 + 1)/3 = 2/3;  0 - (1 + 0 + 1)/3 = -2/3
    close(rloo_advantages(T_([1.0, 0.0, 0.0, 1.0])), [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # valid [1, 0, 0]: 1 - (0 + 0)/2 = 1;  0 - (1 + 0)/2 = -0.5; the invalid entry gets 0
    close(rloo_advantages(T_([1.0, 0.0, 9.0, 0.0]), T_([True, True, False, True])), [1.0, -0.5, 0.0, -0.5])
    close(rloo_advantages(T_([3.0, 1.0]), T_([True, False])), [0.0, 0.0])


def test_reinforce_pp_whitens_across_the_batch():
    # [3, 1, 0, 0]: mean 1, deviations [2, 0, -1, -1], var = (4 + 0 + 1 + 1)/3 = 2, std 1.41421
    close(reinforce_pp_advantages(T_([3.0, 1.0, 0.0, 0.0])), [1.41421, 0.0, -0.70711, -0.70711])


def test_reinforce_pp_baseline_subtracts_group_means_first():
    # groups {1, 0} and {3, 1}: means 0.5 and 2 -> [0.5, -0.5, 1, -1]; batch mean 0,
    # var = (0.25 + 0.25 + 1 + 1)/3 = 0.83333, std 0.91287 -> [0.54772, -0.54772, 1.09545, -1.09545]
    adv = reinforce_pp_advantages(T_([1.0, 0.0, 3.0, 1.0]), group_ids_B=T_([0, 0, 1, 1]))
    close(adv, [0.54772, -0.54772, 1.09545, -1.09545])
    # The last is an error: group 1 is {3} alone -> 0; batch [0.5, -0.5, 0]: mean 0, var 0.5/2, std 0.5.
    adv = reinforce_pp_advantages(T_([1.0, 0.0, 3.0, 1.0]), T_([True, True, True, False]), group_ids_B=T_([0, 0, 1, 1]))
    close(adv, [1.0, -1.0, 0.0, 0.0])


def test_registry_runs_estimators_group_by_group():
    rewards, groups = T_([1.0, 0.0, 0.0, 1.0, 3.0, 1.0]), T_([0, 0, 0, 0, 1, 1])
    # group 1 = {3, 1}: mean 2, std 1.41421 -> +-0.70711; Dr.GRPO +-1; RLOO 3 - 1 = 2, 1 - 3 = -2
    close(ADVANTAGES["grpo"](rewards, None, groups), [0.86603, -0.86603, -0.86603, 0.86603, 0.70711, -0.70711])
    close(ADVANTAGES["dr_grpo"](rewards, None, groups), [0.5, -0.5, -0.5, 0.5, 1.0, -1.0])
    close(ADVANTAGES["rloo"](rewards, None, groups), [2 / 3, -2 / 3, -2 / 3, 2 / 3, 2.0, -2.0])
    # The batch [1, 0, 0, 1, 3, 1]: mean 1, deviations [0, -1, -1, 0, 2, 0], var 6/5, std 1.09545
    close(ADVANTAGES["reinforce_pp"](rewards, None, groups), [0.0, -0.91287, -0.91287, 0.0, 1.82574, 0.0])
    # centered per group: [0.5, -0.5, -0.5, 0.5, 1, -1]; var = (4 * 0.25 + 2)/5 = 0.6, std 0.77460
    close(ADVANTAGES["reinforce_pp_baseline"](rewards, None, groups),
          [0.64550, -0.64550, -0.64550, 0.64550, 1.29099, -1.29099])
    valid = T_([True, True, True, True, True, False])
    close(ADVANTAGES["grpo"](rewards, valid, groups), [0.86603, -0.86603, -0.86603, 0.86603, 0.0, 0.0])
    # Without group ids the input is one group.
    close(ADVANTAGES["grpo"](T_([1.0, 0.0, 0.0, 1.0])), [0.86603, -0.86603, -0.86603, 0.86603])
    close(ADVANTAGES["rloo"](T_([1.0, 0.0, 0.0, 1.0])), [2 / 3, -2 / 3, -2 / 3, 2 / 3])


def test_masked_whiten_ignores_mask_zero_positions():
    # masked values [1, 3]: mean 2, std sqrt(2) -> -+0.70711; the 100 is not part of the statistics
    close(masked_whiten(T_([[1.0, 100.0, 3.0]]), T_([[1, 0, 1]])), [[-0.70711, 0.0, 0.70711]])


# --- GAE over loss-masked tokens -------------------------------------------------------------------------

def test_gae_three_tokens_by_hand():
    # gamma 0.9, lam 0.8 (gamma * lam = 0.72); r = [0, 0, 1], V = [0.5, 0.6, 0.7], V after the end = 0
    #   t=2: delta = 1 + 0 - 0.7 = 0.3;                 A2 = 0.3
    #   t=1: delta = 0 + 0.9 * 0.7 - 0.6 = 0.03;        A1 = 0.03 + 0.72 * 0.3 = 0.246
    #   t=0: delta = 0 + 0.9 * 0.6 - 0.5 = 0.04;        A0 = 0.04 + 0.72 * 0.246 = 0.21712
    # returns = A + V = [0.71712, 0.846, 1.0]
    adv, ret = gae(T_([[0.0, 0.0, 1.0]]), T_([[0.5, 0.6, 0.7]]), T_([[1, 1, 1]]), gamma=0.9, lam=0.8)
    close(adv, [[0.21712, 0.246, 0.3]])
    close(ret, [[0.71712, 0.846, 1.0]])


def test_gae_skips_observation_positions():
    # The same three sampled tokens with a two-token observation after the first one (mask 0, values
    # that the recursion must never read): identical advantages on the sampled tokens, 0 on the gap.
    rewards = T_([[0.0, 0.0, 0.0, 0.0, 1.0]])
    values = T_([[0.5, 100.0, -100.0, 0.6, 0.7]])
    mask = T_([[1, 0, 0, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[0.21712, 0.0, 0.0, 0.246, 0.3]])
    close(ret, [[0.71712, 0.0, 0.0, 0.846, 1.0]])
    no_gap, _ = gae(T_([[0.0, 0.0, 1.0]]), T_([[0.5, 0.6, 0.7]]), T_([[1, 1, 1]]), gamma=0.9, lam=0.8)
    assert torch.equal(adv[:, mask[0].bool()], no_gap)


def test_gae_rejects_rewards_that_it_would_drop():
    with pytest.raises(ValueError, match="mask-0"):
        gae(T_([[1.0, 0.0]]), torch.zeros(1, 2), T_([[0, 1]]))


def test_turn_rewards_land_on_each_turns_last_sampled_token():
    # Turn.end is exclusive: ends 3 and 7 -> positions 2 and 6.
    rewards = turn_rewards_to_tokens([[3, 7], [5]], [[0.5, 1.0], [2.0]], T=8)
    close(rewards, [[0, 0, 0.5, 0, 0, 0, 1.0, 0], [0, 0, 0, 0, 2.0, 0, 0, 0]])
    with pytest.raises(ValueError, match="outside"):
        turn_rewards_to_tokens([[9]], [[1.0]], T=8)
    with pytest.raises(ValueError, match="turn values"):
        turn_rewards_to_tokens([[3, 7]], [[1.0]], T=8)


def test_per_turn_credit_with_turn_rewards_and_gae():
    # prompt [0, 2), turn 1 sampled [2, 4), observation [4, 6), turn 2 sampled [6, 8). Turn rewards 0.5, 1.
    # gamma = lam = 1, values 0: the return to go -> turn 2's tokens 1.0, turn 1's tokens 0.5 + 1.0 = 1.5.
    mask = T_([[0, 0, 1, 1, 0, 0, 1, 1]])
    rewards = turn_rewards_to_tokens([[4, 8]], [[0.5, 1.0]], T=8)
    adv, ret = gae(rewards, torch.zeros(1, 8), mask)
    close(adv, [[0, 0, 1.5, 1.5, 0, 0, 1.0, 1.0]])
    close(ret, [[0, 0, 1.5, 1.5, 0, 0, 1.0, 1.0]])


def test_turn_level_group_advantages():
    # Three trajectories of one task, T = 6. Returns to go (gamma 1): [1, 1], [0, 0], [1].
    # turn 0 across [1, 0, 1]: mean 2/3, var = (1/9 + 4/9 + 1/9)/2 = 1/3 -> [0.57735, -1.15470, 0.57735]
    # turn 1 across [1, 0] (the third has no turn 1): mean 0.5, var 0.5 -> [0.70711, -0.70711]
    rewards = [[0.0, 1.0], [0.0, 0.0], [1.0]]
    spans = [[(1, 3), (4, 6)], [(1, 2), (3, 6)], [(1, 4)]]
    adv = turn_level_group_advantages(rewards, spans, T=6)
    a, b, c = 0.57735, -1.15470, 0.70711
    close(adv, [[0, a, a, 0, c, c], [0, b, 0, -c, -c, -c], [0, a, a, a, 0, 0]])
    # Own rewards without std: turn 0 [0, 0, 1] - 1/3 -> [-1/3, -1/3, 2/3]; turn 1 [1, 0] - 0.5.
    adv = turn_level_group_advantages(rewards, spans, T=6, return_to_go=False, scale_by_std=False)
    t = 1 / 3
    close(adv, [[0, -t, -t, 0, 0.5, 0.5], [0, -t, 0, -0.5, -0.5, -0.5], [0, 2 * t, 2 * t, 2 * t, 0, 0]])
    # Without the second (an error): turn 0 across [1, 1] has no spread, turn 1 has one member -> all 0.
    adv = turn_level_group_advantages(rewards, spans, T=6, valid_G=T_([True, False, True]))
    close(adv, torch.zeros(3, 6).tolist())


# --- cases that mutation testing found unguarded (docs/mutation.md) ----------------------------------------

def test_integer_rewards_give_float_advantages():
    # 0/1 rewards as an int tensor (a verifier's pass/fail): RLOO 1 - (0 + 0)/2 = 1, 0 - (1 + 0)/2 = -0.5, not 0
    adv = rloo_advantages(T_([1, 0, 0]))
    assert adv.dtype == torch.float32 and adv.tolist() == [1.0, -0.5, -0.5]
    # Dr.GRPO over three groups {1, 0}, {0, 1}, {3, 1}: [0.5, -0.5], [-0.5, 0.5], [1, -1]
    adv = ADVANTAGES["dr_grpo"](T_([1, 0, 0, 1, 3, 1]), None, T_([0, 0, 1, 1, 2, 2]))
    assert adv.dtype == torch.float32 and adv.tolist() == [0.5, -0.5, -0.5, 0.5, 1.0, -1.0]


def test_registry_honours_valid_without_group_ids():
    # valid [1, 0, 0] (the 9 is an error): RLOO [1, -0.5, -0.5]; REINFORCE++ over [3, 1, 0, 0] as in
    # test_reinforce_pp_whitens_across_the_batch, and its baseline variant, one group without group ids, the same
    # (whitening is blind to the group mean subtracted first)
    close(ADVANTAGES["rloo"](T_([1.0, 0.0, 9.0, 0.0]), T_([True, True, False, True])), [1.0, -0.5, 0.0, -0.5])
    valid = T_([True, True, True, True, False])
    for name in ("reinforce_pp", "reinforce_pp_baseline"):
        close(ADVANTAGES[name](T_([3.0, 1.0, 0.0, 0.0, 50.0]), valid), [1.41421, 0.0, -0.70711, -0.70711, 0.0])


def test_reinforce_pp_baseline_with_three_groups():
    # groups {1, 0}, {3, 1}, {5, 5}: centered [0.5, -0.5, 1, -1, 0, 0]; mean 0, var = 2.5/5 = 0.5, std 0.70711
    adv = reinforce_pp_advantages(T_([1.0, 0.0, 3.0, 1.0, 5.0, 5.0]), group_ids_B=T_([0, 0, 1, 1, 2, 2]))
    close(adv, [0.70711, -0.70711, 1.41421, -1.41421, 0.0, 0.0])


def test_turn_spans_at_the_edges_and_bad_spans():
    # a turn may start at position 0 and end at T; Dr.GRPO across [1, 0]: +-0.5
    adv = turn_level_group_advantages([[1.0], [0.0]], [[(0, 2)], [(2, 4)]], T=4, scale_by_std=False)
    assert adv.tolist() == [[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, -0.5, -0.5]]
    with pytest.raises(ValueError, match=r"trajectory 0: turn span \[2, 2\) is empty"):
        turn_level_group_advantages([[1.0], [0.0]], [[(2, 2)], [(2, 4)]], T=4)
    with pytest.raises(ValueError, match="2 trajectories of values but 1 of turn spans"):
        turn_level_group_advantages([[1.0], [0.0]], [[(0, 2)]], T=4)
    # a turn that ends at 1 puts its reward on position 0
    assert turn_rewards_to_tokens([[1, 4]], [[0.5, 1.0]], T=4).tolist() == [[0.5, 0.0, 0.0, 1.0]]


def test_turn_level_discounted_returns_and_eps():
    # gamma 0.5: returns to go [1 + 0.5 * 1, 1] = [1.5, 1] and [0]. Turn 0 across [1.5, 0]: mean 0.75, Dr.GRPO
    # +-0.75; turn 1 has one member -> 0. With std and eps 1: std 1.06066 -> 0.75 / 2.06066 = 0.36396
    rewards, spans = [[1.0, 1.0], [0.0]], [[(0, 1), (1, 2)], [(0, 1)]]
    close(turn_level_group_advantages(rewards, spans, T=2, gamma=0.5, scale_by_std=False), [[0.75, 0.0], [-0.75, 0.0]])
    close(turn_level_group_advantages(rewards, spans, T=2, gamma=0.5, eps=1.0), [[0.36396, 0.0], [-0.36396, 0.0]])
    assert turn_level_group_advantages([], [], T=3).shape == (0, 3)


def test_gae_error_says_where_rewards_go():
    with pytest.raises(ValueError, match=r"^gae: nonzero rewards at mask-0 positions would be ignored; put each "
                                         r"turn's reward on its last sampled token \(turn_rewards_to_tokens\)$"):
        gae(T_([[1.0, 0.0]]), torch.zeros(1, 2), T_([[0, 1]]))


def test_valid_of_another_shape_is_an_error():
    with pytest.raises(ValueError, match=r"^valid has shape \(3,\), rewards \(4,\)$"):
        grpo_advantages(T_([1.0, 0.0, 0.0, 1.0]), T_([True, True, False]))
