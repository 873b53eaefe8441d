"""Reward sources: majority vote, controls, length, and their weighted mix, on hand-made trajectories."""

import pytest
import torch

from agentrl.trainers.methods.grpo import to_batch
from agentrl.trainers.rewards import RewardConfig, group_rewards, majority_vote_metrics
from agentrl.types import TYPICAL_STOP, Group, Status, Task, Trajectory


def traj(answer, outcome=0.0, sampled=4, status=Status.OK, seed=0, env_reward=None):
    """A trajectory with `sampled` assistant tokens after a 2-token prompt."""
    n = 2 + sampled
    return Trajectory("t0", tuple(range(n)), (0, 0) + (1,) * sampled, (0.0,) * n, 2, (),
                      outcome if env_reward is None else env_reward, {"outcome": outcome}, TYPICAL_STOP[status],
                      seed=seed, answer=answer)


def test_majority_vote_rewards_agreement_not_correctness():
    group = Group(Task("t0"), (traj("5", 0.0), traj("5.0", 0.0), traj("6", 1.0), traj(None, 0.0)))
    assert group_rewards(group, RewardConfig(terms={"majority_vote": 1.0})) == [1.0, 1.0, 0.0, 0.0]
    metrics = majority_vote_metrics([group])
    assert metrics["majority_label_accuracy"] == 0.0  # the majority, "5", is wrong
    assert metrics["majority_agreement"] == pytest.approx(2 / 4)


def test_sources_mix_with_weights_and_errors_get_no_reward():
    group = Group(Task("t0"), (traj("5", 1.0, sampled=4), traj("5", 0.0, sampled=8),
                               traj("9", 0.0, status=Status.ERROR), traj(None, 0.0, sampled=2, status=Status.TRUNCATED)))
    cfg = RewardConfig(terms={"outcome": 1.0, "format": 0.5, "length": -0.25}, length_norm=8)
    # outcome + 0.5 * answered-and-ok - 0.25 * tokens / 8, for the three valid trajectories
    assert group_rewards(group, cfg) == pytest.approx([1 + 0.5 - 0.125, 0 + 0.5 - 0.25, 0 + 0 - 0.0625])
    assert group_rewards(group, RewardConfig(terms={"inverted": 1.0})) == [0.0, 1.0, 1.0]
    assert group_rewards(group, RewardConfig()) == [1.0, 0.0, 0.0]  # default: the env's reward


def test_random_reward_is_a_seeded_fair_coin():
    group = Group(Task("t0"), tuple(traj("1", seed=s) for s in range(400)))
    a = group_rewards(group, RewardConfig(terms={"random": 1.0}, seed=3))
    assert a == group_rewards(group, RewardConfig(terms={"random": 1.0}, seed=3))
    assert a != group_rewards(group, RewardConfig(terms={"random": 1.0}, seed=4))
    assert set(a) == {0.0, 1.0} and 0.4 < sum(a) / len(a) < 0.6


def test_unknown_sources_are_errors():
    with pytest.raises(ValueError, match="unknown reward sources \\['majority'\\]"):
        RewardConfig(terms={"majority": 1.0})


def test_advantages_come_from_the_training_reward():
    """Majority vote replaces the env's reward in the advantages; the env's stays on the trajectory."""
    group = Group(Task("t0"), (traj("5", 0.0), traj("5", 0.0), traj("6", 1.0)))
    batch = to_batch([group], "grpo", [group_rewards(group, RewardConfig(terms={"majority_vote": 1.0}))])
    # rewards (1, 1, 0): mean 2/3, Bessel std 0.57735 -> advantages (0.57735, 0.57735, -1.1547)
    assert batch.adv_BT[:, -1] == pytest.approx(torch.tensor([0.57735, 0.57735, -1.1547]), abs=1e-4)
    assert [t.reward for t in group.trajectories] == [0.0, 0.0, 1.0]
