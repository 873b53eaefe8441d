"""PPO: token rewards, the critic's alignment, GAE advantages by hand, exact gradient accumulation, and the
loop on the tiny model (runs, logs, checkpoints both models, resumes exactly)."""

import dataclasses
import json
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from agentrl.envs.math import ArithmeticEnv
from agentrl.policy.hf import HFPolicy
from agentrl.policy.logprobs import token_logprobs
from agentrl.policy.protocol import SamplingParams
from agentrl.rollout.engine import RolloutConfig
from agentrl.models.tokenizer import load_tokenizer
from agentrl.trainers.batch import Batch, make_batch
from agentrl.trainers.checkpoint import latest_checkpoint
from agentrl.trainers.methods.grpo import GRPOConfig
from agentrl.trainers import loop
from agentrl.trainers.loop import update
from agentrl.trainers.methods.ppo import PPOConfig, advantages, make_critic, token_rewards, token_values, train
from agentrl.trainers.rewards import RewardConfig
from agentrl.types import Trajectory, Turn


def two_turns(reward_1=0.5, reward_2=1.0):
    # prompt [0, 2) · turn 1 samples [2, 4), observation [4, 6) · turn 2 samples [6, 8)
    ids = (5, 6, 7, 8, 9, 10, 11, 12)
    mask = (0, 0, 1, 1, 0, 0, 1, 1)
    turns = (Turn(2, 4, 6, reward_1), Turn(6, 8, 8, reward_2))
    return Trajectory("t", ids, mask, tuple(-1.0 * m for m in mask), 2, turns, reward_1 + reward_2)


def test_token_rewards_put_turn_rewards_on_each_turns_last_token():
    t = two_turns()
    # env reward only: 0.5 on position 3, 1.0 on position 7
    assert token_rewards([t], [1.5], 8).tolist() == [[0, 0, 0, 0.5, 0, 0, 0, 1.0]]
    # a training reward of 2.0 (other sources): the extra 0.5 goes on the episode's last sampled token
    assert token_rewards([t], [2.0], 8).tolist() == [[0, 0, 0, 0.5, 0, 0, 0, 1.5]]


def test_critic_starts_at_zero_and_values_align_with_the_sampled_position(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    critic = make_critic(model)
    for (name, p), q in zip(critic.base_model.named_parameters(), model.base_model.parameters()):
        assert torch.equal(p, q), name
    ids_BT = torch.tensor([[5, 6, 7, 8, 9, 10]])
    assert token_values(critic, ids_BT, torch.ones_like(ids_BT)).abs().max() == 0
    torch.nn.init.normal_(critic.score.weight, generator=torch.Generator().manual_seed(0))
    values_BT = token_values(critic, ids_BT, torch.ones_like(ids_BT))
    assert values_BT[0, 0] == 0
    for t in range(1, 6):  # V at position t is the value of the prefix ids[:t], the state that samples ids[t]
        prefix = ids_BT[:, :t]
        expected = critic(input_ids=prefix, attention_mask=torch.ones_like(prefix)).logits[0, -1, 0]
        torch.testing.assert_close(values_BT[0, t], expected, atol=1e-5, rtol=1e-5)  # values of size ~10


def test_gae_advantages_by_hand(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    critic = make_critic(model)  # values 0 at first
    t = two_turns()
    batch = make_batch([t], [0.0])
    cfg = PPOConfig(gamma=1.0, lam=1.0, whiten_advantages=False)
    out, values_BT, returns_BT, metrics = advantages(batch, [t], [1.5], critic, None, cfg)
    # V = 0, gamma = lam = 1: A_t is the reward to go over the sampled tokens: 1.5, 1.5 | 1.0, 1.0
    assert out.adv_BT.tolist() == [[0, 0, 1.5, 1.5, 0, 0, 1.0, 1.0]]
    assert returns_BT.tolist() == out.adv_BT.tolist() and values_BT.abs().max() == 0
    # gamma 0.5, lam 1: the discount counts sampled tokens only (the observation is skipped)
    # position 7: 1.0; 6: 0.5 * 1.0; 3: 0.5 + 0.5 * 0.5; 2: 0.5 * 0.75
    out, *_ = advantages(batch, [t], [1.5], critic, None, PPOConfig(gamma=0.5, lam=1.0, whiten_advantages=False))
    assert out.adv_BT.tolist() == [[0, 0, 0.375, 0.75, 0, 0, 0.5, 1.0]]
    # KL folded into the reward: r_t - 0.1 * (logp_t - ref_logp_t) on every sampled token (k1), the policy's own
    # logprobs against a reference that differs from it; with gamma = lam = 1 each A_t is the reward to go
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    logp_BT, _ = token_logprobs(model, batch.ids_BT, batch.attention_BT, mask_BT=batch.mask_BT)
    ref_logp_BT, _ = token_logprobs(ref, batch.ids_BT, batch.attention_BT, mask_BT=batch.mask_BT)
    kl = [(logp_BT - ref_logp_BT)[0, i].item() for i in (2, 3, 6, 7)]
    assert min(abs(k) for k in kl) > 1e-3  # the reference really differs on every sampled token
    r2, r3, r6, r7 = (r - 0.1 * k for r, k in zip((0.0, 0.5, 0.0, 1.0), kl))
    kl_cfg = PPOConfig(gamma=1.0, lam=1.0, whiten_advantages=False, kl_coef=0.1)
    out_kl, _, _, metrics = advantages(batch, [t], [1.5], critic, ref, kl_cfg, policy=model)
    expected = [0, 0, r2 + r3 + r6 + r7, r3 + r6 + r7, 0, 0, r6 + r7, r7]
    torch.testing.assert_close(out_kl.adv_BT, torch.tensor([expected]), atol=1e-6, rtol=0)
    assert metrics["kl"] == pytest.approx(sum(kl) / 4, abs=1e-6)
    # whitened: mean 0 and unit std over the four sampled tokens, 0 elsewhere
    out, *_ = advantages(batch, [t], [1.5], critic, None, PPOConfig(gamma=1.0, lam=1.0))
    sampled = out.adv_BT[batch.mask_BT.bool()]
    assert sampled.mean().abs() < 1e-6 and sampled.std().item() == pytest.approx(1.0, abs=1e-4)
    assert out.adv_BT[~batch.mask_BT.bool()].abs().max() == 0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_give_the_same_update_as_the_whole_minibatch(tiny_model_dir, agg):
    g = torch.Generator().manual_seed(0)
    B, T = 4, 12
    ids = torch.randint(10, 4000, (B, T), generator=g)
    attention = torch.ones(B, T, dtype=torch.long)
    attention[1, 9:] = 0
    attention[3, 6:] = 0
    mask = torch.zeros(B, T)
    mask[0, 3:], mask[1, 5:9], mask[2, 8:], mask[3, 2:6] = 1, 1, 1, 1  # different numbers of sampled tokens
    adv = torch.randn(B, 1, generator=g) * mask
    batch = Batch(ids, attention, mask, torch.full((B, T), -8.0) * mask, adv)
    results = []
    for micro in (None, 1):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        cfg = GRPOConfig(minibatch_size=4, micro_batch_size=micro, max_grad_norm=1e9)
        cfg = dataclasses.replace(cfg, policy_loss=dataclasses.replace(cfg.policy_loss, agg=agg))
        update(model, None, torch.optim.SGD(model.parameters(), lr=1.0), batch, cfg, torch.Generator().manual_seed(0))
        results.append(list(model.parameters()))
    for p, q in zip(*results):
        torch.testing.assert_close(p, q, atol=2e-6, rtol=1e-4)


def mixed_batch(adv_rows):
    """Four sequences with their own sampled spans, advantage `adv_rows[i]` on each of row i's sampled tokens."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(10, 4000, (4, 12), generator=g)
    mask = torch.zeros(4, 12)
    mask[0, 3:], mask[1, 5:9], mask[2, 8:], mask[3, 2:6] = 1, 1, 1, 1
    return Batch(ids, torch.ones(4, 12, dtype=torch.long), mask, torch.full((4, 12), -8.0) * mask,
                 torch.tensor(adv_rows).unsqueeze(1) * mask)


@pytest.mark.parametrize("loss", ["ppo", "gspo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_rows_without_advantage_are_skipped_and_the_update_is_the_same(tiny_model_dir, monkeypatch, loss, agg):
    """Rows whose advantages are all 0 get no forward pass, but still count in the loss's normalizer."""
    batch, results = mixed_batch([0.0, 1.3, 0.0, -0.7]), []
    cfg = GRPOConfig(minibatch_size=4, micro_batch_size=1, max_grad_norm=1e9, loss=loss)
    cfg = dataclasses.replace(cfg, policy_loss=dataclasses.replace(cfg.policy_loss, agg=agg))
    for skipping in (True, False):
        if not skipping:
            monkeypatch.setattr(loop, "ADVANTAGE_WEIGHTED", frozenset())
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
        metrics = update(model, None, torch.optim.SGD(model.parameters(), lr=1.0), batch, cfg,
                         torch.Generator().manual_seed(0))
        assert metrics["skipped_rows_frac"] == (0.5 if skipping else 0.0)
        results.append(list(model.parameters()))
    for p, q in zip(*results):
        torch.testing.assert_close(p, q, atol=1e-12, rtol=1e-10)


def test_a_minibatch_without_advantage_makes_no_optimizer_step(tiny_model_dir):
    """AdamW would move the weights on a zero gradient (weight decay); a step with nothing to learn leaves them."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = update(model, None, torch.optim.AdamW(model.parameters(), lr=1e-2), mixed_batch([0.0] * 4),
                     GRPOConfig(minibatch_size=2), torch.Generator().manual_seed(0))
    assert metrics == {"skipped_rows_frac": 1.0}
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))


CFG = PPOConfig(steps=4, tasks_per_step=4, lr=1e-3, critic_lr=1e-3, minibatch_size=4, micro_batch_size=2, epochs=2,
                checkpoint_every=1, kl_coef=0.05, reward=RewardConfig(terms={"env": 1.0, "length": -0.001}),
                group_size=1, rollout=RolloutConfig(max_total_tokens=1024, sampling=SamplingParams(max_tokens=12)))


def run(model_dir, out_dir, steps):
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    policy = HFPolicy(model, tokenizer)
    tasks = list(ArithmeticEnv(n_tasks=16).tasks)
    cfg = dataclasses.replace(CFG, steps=steps)
    return train(cfg, model, tokenizer, policy, lambda: ArithmeticEnv(n_tasks=16), tasks, out_dir)


@pytest.mark.slow
def test_ppo_runs_and_resumes_exactly(tiny_model_dir, tmp_path):
    straight = run(tiny_model_dir, tmp_path / "straight", 4)
    m = straight[0]
    # the untrained model earns nothing and writes until max_tokens: 4 single-turn episodes of 12 tokens, so the
    # training reward is the length penalty alone, -0.001 * 12 / 1024
    assert m["mean_reward"] == 0 and m["error_frac"] == 0 and m["truncated_frac"] == 1 and m["groups_trained"] == 4
    assert m["sampled_tokens"] == m["trained_tokens"] == 4 * 12
    assert m["train_reward"] == pytest.approx(-0.001 * 12 / CFG.reward.length_norm, rel=1e-6)
    assert m["tokens_per_s"] == pytest.approx(m["sampled_tokens"] / m["time"]["rollout"], rel=1e-9)
    # before the first update the policy is the reference (KL 0) and the critic is 0 (advantages = returns)
    assert m["kl"] == 0 and m["advantage_mean"] == pytest.approx(m["return_mean"], abs=1e-9)
    assert m["return_mean"] < 0  # the length penalty
    assert m["grad_norm"] > 0 and m["value_grad_norm"] > 0
    assert m["value_loss"] == pytest.approx(0.5 * m["value_mse"], rel=1e-5)  # the clipped loss, nothing clipped
    assert m["value_clip_frac"] == 0
    assert 0 < m["entropy"] <= math.log(AutoConfig.from_pretrained(tiny_model_dir).vocab_size)  # nearly uniform
    assert 0 <= m["clip_frac"] <= 1 and m["approx_kl"] >= 0 and m["ratio_min"] <= m["ratio_mean"] <= m["ratio_max"]
    assert m["sampler_logprob_diff_max"] < 1e-4  # before the first update, trainer logprobs == sampler's

    run(tiny_model_dir, tmp_path / "resumed", 2)  # "killed" after step 2: only its checkpoint survives
    resumed = run(tiny_model_dir, tmp_path / "resumed", 4)
    assert len(resumed) == 2
    for a, b in zip(straight[2:], resumed):
        assert a["mean_reward"] == b["mean_reward"] and a["sampled_tokens"] == b["sampled_tokens"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["value_loss"] == pytest.approx(b["value_loss"], abs=1e-6)
    lines = (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4]
    checkpoint = latest_checkpoint(tmp_path / "resumed")
    AutoModelForCausalLM.from_pretrained(checkpoint)  # both are plain transformers models
    AutoModelForTokenClassification.from_pretrained(checkpoint / "critic")


def test_ppo_config_says_what_is_wrong():
    with pytest.raises(TypeError, match="dynamic_sampling"):  # a GRPO option: PPO's critic is the baseline
        PPOConfig(dynamic_sampling=True)
    with pytest.raises(ValueError, match="gamma and lam"):
        PPOConfig(lam=1.5)
    with pytest.raises(ValueError, match="micro_batch_size"):
        PPOConfig(minibatch_size=8, micro_batch_size=16)


def test_advantages_in_micro_batches_equal_the_whole_batch(tiny_model_dir):
    """The critic's, the policy's and the reference's passes over the step batch, a micro-batch at a time. In
    float64, so that what is compared is the batching, not float32's rounding in batches of other shapes."""
    model, ref = (AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64) for _ in range(2))
    with torch.no_grad():
        ref.lm_head.weight.mul_(1.1)  # a KL that is not 0
    critic = make_critic(model)
    torch.nn.init.normal_(critic.score.weight, generator=torch.Generator().manual_seed(0))  # values that are not 0
    g = torch.Generator().manual_seed(2)
    trajectories = []
    for n in (8, 12, 5, 10, 7):  # rows of different lengths: each micro-batch is trimmed to its longest
        ids = tuple(torch.randint(10, 4000, (n,), generator=g).tolist())
        mask = (0, 0) + (1,) * (n - 2)
        trajectories.append(Trajectory("t", ids, mask, (-1.0,) * n, 2, (Turn(2, n, n, 1.0),), 1.0))
    batch, rewards_B = make_batch(trajectories, [0.0] * 5), [1.0, 0.0, 0.5, -1.0, 2.0]
    results = []
    for minibatch, micro, tokens in ((5, None, None), (2, None, None), (4, 3, None), (4, 1, None), (5, None, 20)):
        cfg = PPOConfig(minibatch_size=minibatch, micro_batch_size=micro, micro_batch_tokens=tokens, kl_coef=0.1,
                        lam=0.9)
        out, values_BT, returns_BT, metrics = advantages(batch, trajectories, rewards_B, critic, ref, cfg, policy=model)
        results.append((out.adv_BT, values_BT, returns_BT, torch.tensor(metrics["kl"])))
    assert results[0][1].abs().min() == 0 and results[0][1].abs().max() > 0.1 and results[0][3] != 0
    for got in results[1:]:
        for a, c in zip(results[0], got):
            torch.testing.assert_close(c, a, atol=1e-6, rtol=0)
