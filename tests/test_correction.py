"""The sampler/trainer correction in the real update (`loop.update`): a run whose sampler reports perturbed
logprobs learns like the unperturbed one with decoupled PPO + TIS, and hardly at all without them.

The task: the tiny model answers one prompt with 4 sampled tokens, rewarded by the share of even token ids;
16 steps of 16 samples (GRPO advantages, PPO clip, 2 epochs of minibatches of 8, AdamW lr 1e-3). The learning
metric is exact: the probability of an even first token, 0.498 at the start. The perturbation adds N(0, 1)
noise to every logprob the sampler reports (the tokens are still drawn from the model). Measured: clean 0.611,
perturbed 0.508 uncorrected, 0.606 with decoupled + token TIS (decoupled alone: 0.611; its weights are 1 here).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl.models.tokenizer import load_tokenizer
from agentrl.policy.hf import HFPolicy
from agentrl.policy.protocol import SamplingParams
from agentrl.trainers.advantages import grpo_advantages
from agentrl.trainers.batch import Batch
from agentrl.trainers.loop import LoopConfig, model_logprobs, update
from agentrl.trainers.losses import CorrectionConfig, PolicyLossConfig

STEPS, G, MAX_TOKENS, LR = 16, 16, 4, 1e-3


def p_even_first(model, prompt: list[int]) -> float:
    """The exact probability that the first sampled token has an even id."""
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1].float().softmax(-1)[0::2].sum().item()


def train(model_dir, correction: CorrectionConfig, noise: float) -> tuple[list[float], dict]:
    """(p_even_first after each step, the last step's metrics) of a run whose sampler's logprobs get `noise`."""
    tokenizer = load_tokenizer(model_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Pick a number."}], add_generation_prompt=True,
                                         tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = HFPolicy(model, tokenizer)  # samples with the trainer's own weights: the sync is the identity
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    cfg = LoopConfig(lr=LR, epochs=2, minibatch_size=8, policy_loss=PolicyLossConfig(), correction=correction)
    shuffles, noise_gen, curve, metrics = torch.Generator().manual_seed(0), torch.Generator().manual_seed(123), [], {}
    for step in range(STEPS):
        samples = asyncio.run(policy.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, n=G, seed=1000 * step)))
        P, T = len(prompt), len(prompt) + max(len(s.token_ids) for s in samples)
        ids_BT, attention_BT = torch.zeros(G, T, dtype=torch.long), torch.zeros(G, T, dtype=torch.long)
        mask_BT, sampler_BT = torch.zeros(G, T), torch.zeros(G, T)
        for b, s in enumerate(samples):
            n = P + len(s.token_ids)
            ids_BT[b, :n], attention_BT[b, :n], mask_BT[b, P:n] = torch.tensor(prompt + list(s.token_ids)), 1, 1
            logp_N = torch.tensor(s.logprobs)
            sampler_BT[b, P:n] = logp_N + noise * torch.randn(logp_N.shape, generator=noise_gen)  # the perturbation
        rewards_G = torch.tensor([sum(t % 2 == 0 for t in s.token_ids) / len(s.token_ids) for s in samples])
        adv_BT = grpo_advantages(rewards_G)[:, None] * mask_BT
        metrics = update(model, None, optimizer, Batch(ids_BT, attention_BT, mask_BT, sampler_BT, adv_BT), cfg,
                         shuffles)
        curve.append(p_even_first(model, prompt))
    asyncio.run(policy.close())
    return [p_even_first(AutoModelForCausalLM.from_pretrained(model_dir), prompt), *curve], metrics


@pytest.fixture
def one_thread():
    """The tiny model gains nothing from more threads, and on a shared 2-core machine two of them wait on each
    other (measured: 19 s per run on one thread, 220 s on two under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_corrected_run_on_perturbed_logprobs_learns_like_the_clean_run(tiny_model_dir, one_thread) -> None:
    clean, _ = train(tiny_model_dir, CorrectionConfig(), noise=0.0)
    perturbed, _ = train(tiny_model_dir, CorrectionConfig(), noise=1.0)
    corrected, m = train(tiny_model_dir, CorrectionConfig(decoupled=True, tis="token", tis_cap=2.0), noise=1.0)
    gain = {name: curve[-1] - curve[0] for name, curve in
            (("clean", clean), ("perturbed", perturbed), ("corrected", corrected))}
    print({k: round(v, 4) for k, v in gain.items()}, {k: round(v, 3) for k, v in m.items()})
    assert gain["clean"] > 0.05  # the task is learned in 16 steps (measured: +0.113)
    assert abs(gain["corrected"] - gain["clean"]) < 0.25 * gain["clean"]  # measured: +0.108
    assert gain["perturbed"] < 0.5 * gain["clean"]  # measured: +0.010: the noise clips the ratio's gradient away
    # the step logs the mismatch and the correction's share of truncated tokens
    assert m["mismatch_kl_k3"] > 0.3 and 0.1 < m["tis_truncated_frac"] < 0.6 and m["sampler_logprob_diff_max"] > 1


def test_loop_config_refuses_tis_with_the_covariance_losses() -> None:
    with pytest.raises(ValueError, match="rl.correction.tis folds the weight into the advantage"):
        LoopConfig(loss="clip_cov", correction=CorrectionConfig(decoupled=True, tis="token"))
    LoopConfig(loss="kl_cov", correction=CorrectionConfig(decoupled=True, mis="sequence"))  # MIS is a mask: any loss
    assert LoopConfig().correction == CorrectionConfig(decoupled=False, tis=None, mis=None)  # off by default


def test_the_recomputed_logprobs_hold_no_graph(tiny_model_dir):
    """Decoupled PPO's (and a distillation teacher's) logprobs come from passes without gradients: a graph kept
    with them would hold every pass's activations through the whole update."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids_BT = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 0]])
    mask_BT = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
    batch = Batch(ids_BT, (ids_BT > 0).long(), mask_BT, torch.zeros(2, 4), torch.zeros(2, 4))
    logp_BT = model_logprobs(model, batch, LoopConfig())
    assert logp_BT.grad_fn is None and not logp_BT.requires_grad
    assert (logp_BT[mask_BT == 1] < 0).all() and (logp_BT[mask_BT == 0] == 0).all()


def test_decoupled_ppo_recomputes_only_the_rows_the_update_trains(tiny_model_dir, monkeypatch):
    """Rows whose advantages are all 0 (groups whose rewards did not vary) are skipped by the update, so their
    logprobs are not recomputed; the others get exactly the full batch's recomputed values, TIS weight folded in."""
    import agentrl.trainers.loop as loop
    from agentrl.trainers.loop import decoupled, inert

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids_BT = torch.tensor([[5, 6, 7, 8, 9], [9, 10, 11, 0, 0], [12, 13, 14, 15, 0], [16, 17, 18, 19, 20]])
    mask_BT = torch.tensor([[0.0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]])
    sampler_BT = -torch.rand(4, 5) * mask_BT
    adv_BT = torch.tensor([0.5, 0.0, -0.5, 0.0])[:, None] * mask_BT
    batch = Batch(ids_BT, (ids_BT > 0).long(), mask_BT, sampler_BT, adv_BT)
    cfg = LoopConfig(correction=CorrectionConfig(decoupled=True, tis="token"))
    rows, token_logprobs = [], loop.token_logprobs
    monkeypatch.setattr(loop, "token_logprobs", lambda m, ids_BT, *a, **kw: rows.append(len(ids_BT)) or
                        token_logprobs(m, ids_BT, *a, **kw))
    corrected, metrics = decoupled(model, batch, cfg, inert(batch))
    assert sum(rows) == 2  # rows 0 and 2
    trainer_BT = model_logprobs(model, batch, cfg)  # every row, for the comparison
    active = torch.tensor([0, 2])
    assert torch.allclose(corrected.old_logp_BT[active], trainer_BT[active], atol=1e-6)
    assert torch.equal(corrected.old_logp_BT[[1, 3]], sampler_BT[[1, 3]])  # inert: untouched
    weights = torch.exp(trainer_BT - sampler_BT).clamp(max=2.0)
    assert torch.allclose(corrected.adv_BT, adv_BT * weights * mask_BT, atol=1e-5)
    assert metrics["tis_weight_mean"] == pytest.approx(weights[active][mask_BT[active] == 1].mean().item(), abs=1e-5)
    rows.clear()
    idle = replace(batch, adv_BT=torch.zeros(4, 5))
    assert decoupled(model, idle, cfg, inert(idle)) == (idle, {}) and rows == []  # nothing to train: no pass
