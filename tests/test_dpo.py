"""DPO: the loss against a hand-worked example, pairing, and a few steps on the tiny model."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl.trainers.methods.dpo import DPOConfig, preference_pairs, train_dpo
from agentrl.trainers.losses import dpo_loss
from agentrl.trainers.rewards import RewardConfig
from agentrl.types import TYPICAL_STOP, Group, Status, Task, Trajectory

NAN = float("nan")


def test_dpo_loss_matches_a_hand_worked_example():
    # Rows: (chosen, rejected) of pair 1, then of pair 2. Position 0 is the prompt (mask 0, junk there).
    logp = torch.tensor([[NAN, -1.0, -2.0], [NAN, -2.0, -2.0], [5.0, -1.0, -1.0], [5.0, -3.0, -1.0]],
                        requires_grad=True)
    ref = torch.tensor([[NAN, -1.5, -2.0], [NAN, -1.0, -2.0], [0.0, -1.0, -1.0], [0.0, -3.0, -1.0]])
    mask = torch.tensor([[0, 1, 1]] * 4, dtype=torch.float)
    loss, metrics = dpo_loss(logp, ref, mask, beta=0.1)
    # pair 1: chosen (-3) - (-3.5) = 0.5; rejected (-4) - (-3) = -1; margin 1.5; z = 0.15
    # pair 2: both equal to the reference: margin 0, z = 0, loss log 2
    expected = (math.log(1 + math.exp(-0.15)) + math.log(2)) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-6)  # 0.657055
    assert metrics == pytest.approx({"reward_accuracy": 0.5, "reward_margin": 0.75})
    loss.backward()
    g = logp.grad
    assert torch.isfinite(g).all() and (g[:, 0] == 0).all()  # nothing flows into masked positions
    # d loss / d chosen token = -beta * sigmoid(-z) / 2 (mean over 2 pairs); the rejected gets the opposite
    assert g[0, 1].item() == pytest.approx(-0.1 * (1 / (1 + math.exp(0.15))) / 2, abs=1e-6)
    assert g[1, 1].item() == pytest.approx(-g[0, 1].item(), abs=1e-7)

    smoothed, _ = dpo_loss(logp.detach(), ref, mask, beta=0.1, label_smoothing=0.1)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    pair1 = -(0.9 * math.log(sig(0.15)) + 0.1 * math.log(sig(-0.15)))
    assert smoothed.item() == pytest.approx((pair1 + math.log(2)) / 2, abs=1e-6)
    with pytest.raises(ValueError, match="pairs"):
        dpo_loss(logp[:3], ref[:3], mask[:3])


def traj(reward, status=Status.OK, ids=(1, 2, 3)):
    return Trajectory("t", ids, (0, 1, 1), (0.0, -1.0, -1.0), 1, (), reward, {"outcome": reward}, TYPICAL_STOP[status])


def test_pairs_are_best_against_worst_of_valid_trajectories():
    a, b, c, err = traj(0.5), traj(1.0), traj(0.0), traj(5.0, Status.ERROR)
    assert preference_pairs([Group(Task("x"), (a, b, c, err))]) == [(b, c)]
    assert preference_pairs([Group(Task("x"), (a, traj(0.5)))]) == []  # no preference between equals
    assert preference_pairs([Group(Task("x"), (a, err))]) == []
    with pytest.raises(ValueError, match="No preference pairs"):
        train_dpo(torch.nn.Linear(1, 1), [], DPOConfig())


def test_dpo_training_prefers_the_chosen_episode(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    chosen, rejected = traj(1.0, ids=(5, 60, 70)), traj(0.0, ids=(5, 90, 100))
    history = train_dpo(model, [(chosen, rejected)] * 4, DPOConfig(epochs=5, lr=1e-3, pairs_per_step=4, beta=0.5))
    assert history[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)  # the model starts as its reference
    assert history[-1]["loss"] < 0.3 and history[-1]["reward_accuracy"] == 1.0


def test_pairs_can_be_ranked_by_any_reward_source():
    short = traj(0.0)
    long = Trajectory("t", (1, 2, 3, 4, 5), (0, 1, 1, 1, 1), (0.0,) * 5, 1, (), 0.0, {"outcome": 0.0})
    group = Group(Task("x"), (long, short))
    assert preference_pairs([group]) == []  # equal env rewards
    assert preference_pairs([group], RewardConfig(terms={"length": -1.0})) == [(short, long)]
