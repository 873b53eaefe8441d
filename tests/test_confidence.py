"""Rewards from the policy's confidence (RENT, self-certainty): hand-worked tables, the trainer's scoring of real
sequences against a plain forward, and the sources in a GRPO step."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from agentrl.trainers.rewards.confidence import confidence_metrics, confidence_of, response_confidence, score_confidence
from agentrl.trainers.methods.grpo import GRPO, GRPOConfig
from agentrl.trainers.rewards import RewardConfig, group_rewards
from agentrl.types import TYPICAL_STOP, Group, Status, Task, Trajectory, Turn

LN2 = math.log(2)


def test_entropy_and_self_certainty_of_a_hand_worked_table():
    logp_NV = torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.25] * 4]).log()
    entropy_N, certainty_N = confidence_of(logp_NV)
    # H = .5 ln2 + .25 * 2 ln2 + 2 * .125 * 3 ln2 = 1.75 ln2; KL(U || p) = -ln 4 + (1 + 2 + 3 + 3) ln2 / 4 = .25 ln2
    assert entropy_N.tolist() == pytest.approx([1.75 * LN2, 2 * LN2])
    assert certainty_N.tolist() == pytest.approx([0.25 * LN2, 0.0], abs=1e-7)  # uniform: maximal H, no certainty


def sampled(ids, mask, reward=0.0, status=Status.OK):
    return Trajectory("t0", tuple(ids), tuple(mask), (0.0,) * len(ids), 2, (), reward, {"outcome": reward},
                      TYPICAL_STOP[status])


def test_scores_are_the_means_over_sampled_tokens_of_a_plain_forward(tiny_model_dir):
    """Two turns (the env's tokens between them are not the policy's) and rows of unequal length, against the
    model's own logits over the whole sequence."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    V = model.config.vocab_size
    a = sampled(torch.randint(V, (14,)).tolist(), [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 1])
    b = sampled(torch.randint(V, (6,)).tolist(), [0, 0, 1, 1, 1, 1])
    got = response_confidence(model.train(), [a, b], tokens_per_pass=16)  # two passes; dropout back on after
    assert model.training
    model.eval()
    for t, scores in zip([a, b], got):
        with torch.no_grad():
            logp_TV = F.log_softmax(model(torch.tensor([t.token_ids])).logits[0, :-1].float(), -1)
        at = [i - 1 for i, m in enumerate(t.loss_mask) if m]  # the distribution that predicted each sampled token
        entropy_N, certainty_N = confidence_of(logp_TV[at])
        assert scores["entropy"] == pytest.approx(entropy_N.mean().item(), rel=1e-4)
        assert scores["self_certainty"] == pytest.approx(certainty_N.mean().item(), rel=1e-4)
        assert 0 < scores["entropy"] <= math.log(V) and scores["self_certainty"] >= 0


def test_sources_read_the_scores_and_need_them(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    V = model.config.vocab_size
    ts = tuple(sampled(torch.randint(V, (8,), generator=torch.Generator().manual_seed(i)).tolist(),
                       [0, 0, 1, 1, 1, 1, 1, 1], reward=float(i % 2)) for i in range(4))
    group = Group(Task("t0"), ts + (sampled([1, 2, 3], [0, 0, 1], status=Status.ERROR),))
    cfg = RewardConfig(terms={"rent": 1.0, "self_certainty": 0.5, "env": 1.0})
    with pytest.raises(RuntimeError, match="score_confidence"):
        group_rewards(group, cfg)
    assert group_rewards(group, cfg, skip=("rent", "self_certainty")) == [0.0, 1.0, 0.0, 1.0]
    score_confidence(model, [group])
    assert "entropy" not in group.trajectories[-1].metrics  # an error is neither scored nor rewarded
    expected = [-t.metrics["entropy"] + 0.5 * t.metrics["self_certainty"] + t.reward for t in ts]
    assert group_rewards(group, cfg) == pytest.approx(expected)
    metrics = confidence_metrics([group])
    assert metrics["confidence/entropy"] == pytest.approx(sum(t.metrics["entropy"] for t in ts) / 4)
    assert -1 <= metrics["confidence/rent_env_reward_corr"] <= 1


def test_grpo_steps_on_rent_alone_keep_every_group_and_lower_the_entropy(tiny_model_dir):
    """Keep sees no reward yet (the confidence is scored at training time) and keeps varied groups even with
    dynamic sampling; a few steps of RENT on the same responses make the model more certain of them."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    V = model.config.vocab_size
    ids = [torch.randint(V, (10,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(4)]
    mask = (0, 0, 0, 0, 1, 1, 1, 1, 1, 1)

    def group() -> Group:  # the responses with the model's current logprobs, as a sampler would have them
        with torch.no_grad():
            logp_BT = F.log_softmax(model(torch.tensor(ids)).logits[:, :-1].float(), -1)
            logp_BT = logp_BT.gather(-1, torch.tensor(ids)[:, 1:, None]).squeeze(-1)
        return Group(Task("t0"), tuple(Trajectory("t0", tuple(x), mask, (0.0, *logp_T.tolist()), 2, (), 0.0, {})
                                       for x, logp_T in zip(ids, logp_BT)))

    cfg = GRPOConfig(reward=RewardConfig(terms={"rent": 1.0}), dynamic_sampling=True, lr=1e-3, minibatch_size=4)
    grpo = GRPO(cfg, model, torch.optim.AdamW(model.parameters(), lr=cfg.lr))
    first = group()
    assert grpo.keep(first)
    entropy = [grpo.train_step([g], [g], step)["confidence/entropy"]
               for step, g in enumerate([first] + [group() for _ in range(4)])]
    assert entropy[-1] < entropy[0], entropy


def test_dpo_pairs_by_confidence_need_the_model(tiny_model_dir):
    from agentrl.trainers.methods.dpo import preference_pairs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    V = model.config.vocab_size
    ts = tuple(sampled(torch.randint(V, (8,), generator=torch.Generator().manual_seed(i)).tolist(),
                       [0, 0, 1, 1, 1, 1, 1, 1]) for i in range(4))
    group, cfg = Group(Task("t0"), ts), RewardConfig(terms={"rent": 1.0})
    with pytest.raises(ValueError, match="needs the policy's model"):
        preference_pairs([group], cfg)
    [(chosen, rejected)] = preference_pairs([group], cfg, model=model)
    entropy = [t.metrics["entropy"] for t in ts]
    assert chosen.metrics["entropy"] == min(entropy)
    assert rejected.metrics["entropy"] == max(entropy)


def test_a_ppo_step_scores_the_confidence_it_trains_on(tiny_model_dir):
    from agentrl.trainers.methods.ppo import PPO, PPOConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    V = model.config.vocab_size
    ids = torch.randint(V, (10,), generator=torch.Generator().manual_seed(0)).tolist()
    mask = (0, 0, 0, 0, 1, 1, 1, 1, 1, 1)  # one turn: PPO puts its reward on the turn's last token
    group = Group(Task("t0"), (Trajectory("t0", tuple(ids), mask, (0.0,) * 10, 4, (Turn(4, 10, 10),), 0.0, {}),))
    cfg = PPOConfig(reward=RewardConfig(terms={"rent": 1.0}), minibatch_size=1)
    ppo = PPO(cfg, model, torch.optim.AdamW(model.parameters(), lr=cfg.lr))
    assert ppo.keep(group)  # nothing scored yet: keep does not need the confidence
    metrics = ppo.train_step([group], [group], 0)
    entropy = group.trajectories[0].metrics["entropy"]
    assert metrics["train_reward"] == pytest.approx(-entropy)
    assert metrics["confidence/entropy"] == pytest.approx(entropy)
