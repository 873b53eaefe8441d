"""The parity gate as a statistic, without vLLM: an in-process engine on a bfloat16 copy of the tiny model passes
against the float32 trainer, a half re-randomized one fails, an engine that missed one sync of a confident policy
fails, and the report's numbers are worked out by hand. (tests/test_vllm.py checks the gate on a real vLLM server.)"""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl.models.tokenizer import load_tokenizer
from agentrl.policy.hf import HFPolicy
from agentrl.policy.parity import (PROBE_TEXT, ParityCheck, ParityError, ParityReport, Probe, check_parity, compare,
                                   mean_thresholds_for, trainer_logprobs, trainer_scores)
from agentrl.policy.protocol import SamplingParams

QUESTIONS = ["What is 3 * (4 + 5)?", "Hi", "Compute 12 + 30, then halve it."]


@pytest.fixture(scope="module")
def trainer(tiny_model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> tuple[tuple[int, ...], ...]:
    tok = load_tokenizer(tiny_model_dir)
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in QUESTIONS]
    return tuple(tuple(tok.encode(t, add_special_tokens=False)) for t in texts)


async def engine_check(engine_model, trainer, tiny_model_dir: Path, check: ParityCheck) -> ParityReport:
    policy = HFPolicy(engine_model, load_tokenizer(tiny_model_dir))
    try:
        return await check_parity(policy, trainer, check)
    finally:
        await policy.close()


def test_mean_thresholds_follow_the_served_dtype() -> None:
    assert mean_thresholds_for("float32") == (1e-3, 1e-3) and mean_thresholds_for("bfloat16") == (5e-2, 0.25)
    assert mean_thresholds_for("auto") == (5e-2, 0.25)  # vLLM's "auto" on GPU serves fp16/bf16
    with pytest.raises(ValueError, match="no default parity threshold for dtype 'int8'"):
        mean_thresholds_for("int8")
    with pytest.raises(ValueError, match="tail_share"):
        ParityCheck(prompts=((1,),), tail_share=1.0)
    with pytest.raises(ValueError, match="top_k in"):
        ParityCheck(prompts=((1,),), top_k=21)


def engine_probe(trainer, prompt, sampled, offsets, top=None) -> Probe:
    """What an engine would report: the trainer's logprobs minus `offsets` (one per token after the first), and the
    alternatives `top` (position -> {token: logprob})."""
    ids = [*prompt, *sampled]
    logprobs = trainer_scores(trainer, [(ids, list(enumerate(ids[1:])))])[0] - torch.tensor(offsets)
    return Probe(tuple(ids), len(prompt), tuple(logprobs.tolist()),
                 tuple((top or {}).get(i, {}) for i in range(len(ids) - 1)))


def test_report_by_hand(trainer) -> None:
    """Engine logprobs = the trainer's + known offsets, so every number of the report is known. One-token prompts:
    every compared token was sampled."""
    probes = [engine_probe(trainer, (5,), (9, 11, 7, 4), (0.0, 0.5, -0.5, 3.0)),
              engine_probe(trainer, (8,), (3, 6), (0.0, -0.1))]  # 6 tokens
    report = compare(trainer, probes, tail_nats=2.0)
    # |Δ| = 0, .5, .5, 3, 0, .1: mean 4.1 / 6; sorted 0, 0, .1, .5, .5, 3: p50 = (.1 + .5) / 2 = .3 (linear),
    # p99 = .5 + 0.95 * (3 - .5) = 2.875 (position 0.99 * 5 = 4.95); one token of 6 over 2 nats.
    assert report.mean_abs_diff == pytest.approx(4.1 / 6, abs=1e-6)
    assert report.p50_abs_diff == pytest.approx(0.3, abs=1e-6)
    assert report.p99_abs_diff == pytest.approx(2.875, abs=1e-5)
    assert report.max_abs_diff == pytest.approx(3.0, abs=1e-6)
    assert report.tail_share == pytest.approx(1 / 6, abs=1e-7)
    assert (report.num_tokens, report.num_sequences) == (6, 2)
    assert report.kinds == {"sampled": (6, pytest.approx(4.1 / 6, abs=1e-6))}
    ratio = (1 + torch.tensor([0.5, -0.5, 3.0, -0.1]).exp().sum().item() + 1) / 6  # exp(logp_trainer - logp_engine)
    assert report.mean_importance_ratio == pytest.approx(ratio, rel=1e-6)
    text = str(report)
    assert "mean 6.83e-01" in text and "p50 3.00e-01" in text and "p99 2.87e+00" in text and "max 3.00e+00" in text
    assert "16.7% of tokens over 2 nats" in text and "over 6 tokens of 2 sequences: 6 sampled (mean 6.8e-01)" in text


def test_kinds_by_hand(trainer, prompts) -> None:
    """Prompt tokens, sampled tokens, the engine's alternatives and the probe text, each counted and averaged apart;
    the importance ratio only over the sampled tokens."""
    P = len(prompts[0])
    alternative = 17  # the engine's alternative at the first sampled position, 1.5 nats off
    exact = trainer_scores(trainer, [([*prompts[0], 9], [(P - 1, alternative)])])[0].item()
    chat = engine_probe(trainer, prompts[0], (9, 11), [0.0] * (P - 1) + [0.2, 0.0],
                        top={P - 1: {9: 0.0, alternative: exact - 1.5}})  # the token itself is not an alternative
    text = engine_probe(trainer, (1, 2, 3, 4), (5,), (0.4, 0.4, 0.4, 0.0))  # what follows the text counts as probe
    report = compare(trainer, [chat], probe_text=text)
    assert report.kinds == {"sampled": (2, pytest.approx(0.1, abs=1e-6)), "prompt": (P - 1, pytest.approx(0, abs=1e-6)),
                            "probe": (4, pytest.approx(0.3, abs=1e-6)), "top-k": (1, pytest.approx(1.5, abs=1e-5))}
    assert report.num_tokens == 2 + (P - 1) + 4 + 1 and report.num_sequences == 2
    assert report.mean_importance_ratio == pytest.approx((1 + math.exp(0.2)) / 2, rel=1e-6)
    assert f"2 sampled (mean 1.0e-01), {P - 1} prompt (mean" in str(report)
    gate = ParityCheck(prompts=prompts, mean_threshold=0.1, unsampled_mean_threshold=1.0)
    assert gate.failures(report) == ["top-k tokens' mean |Δlogp| 1.50e+00 > 1 nats"]


def test_gate_mean_and_tail() -> None:
    base = ParityReport(mean_abs_diff=0.02, p50_abs_diff=0.01, p99_abs_diff=0.5, max_abs_diff=1.5, tail_share=0.0,
                        tail_nats=2.0, mean_importance_ratio=1.0, num_tokens=200, num_sequences=4,
                        kinds={"sampled": (50, 0.02), "prompt": (150, 0.2)})
    sampled, unsampled = mean_thresholds_for("bfloat16")
    bf16 = ParityCheck(prompts=((1,),), mean_threshold=sampled, unsampled_mean_threshold=unsampled)
    assert bf16.failures(base) == []  # bf16 kernel noise: a max of 1.5 nats is no longer an error
    assert ParityCheck(prompts=((1,),)).failures(base) == [  # float32
        "sampled tokens' mean |Δlogp| 2.00e-02 > 0.001 nats", "prompt tokens' mean |Δlogp| 2.00e-01 > 0.001 nats"]
    # 3 of 200 tokens 2.5 nats off, the rest exact: the means pass, the tail (1.5 % > 1 %) does not
    tail = replace(base, mean_abs_diff=3 * 2.5 / 200, max_abs_diff=2.5, tail_share=3 / 200,
                   kinds={"sampled": (200, 3 * 2.5 / 200)})
    assert bf16.failures(tail) == ["1.5% of tokens over 2 nats (at most 1.0%)"]


async def test_bf16_engine_passes_against_fp32_trainer(trainer, prompts, tiny_model_dir) -> None:
    sampled, unsampled = mean_thresholds_for("bfloat16")
    check = ParityCheck(prompts=prompts, mean_threshold=sampled, unsampled_mean_threshold=unsampled)
    report = await engine_check(copy.deepcopy(trainer).to(torch.bfloat16), trainer, tiny_model_dir, check)
    print(f"bf16 engine vs fp32 trainer: {report}")  # measured: mean 2e-3, max 6e-3 nats
    assert report.max_abs_diff > 1e-3  # the old gate (max over tokens <= 1e-3 nats) rejected it
    assert report.mean_abs_diff < 1e-2 and report.tail_share == 0.0
    with pytest.raises(ParityError, match="mean"):  # a gate far tighter than bf16 noise fails it
        await engine_check(copy.deepcopy(trainer).to(torch.bfloat16), trainer, tiny_model_dir,
                           replace(check, mean_threshold=1e-4))


async def test_half_rerandomized_engine_fails(trainer, prompts, tiny_model_dir) -> None:
    """A half-reloaded model: the last half of the layers hold other weights."""
    broken = copy.deepcopy(trainer)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in broken.model.layers[len(broken.model.layers) // 2:]:
            for p in layer.parameters():
                if p.dim() > 1:
                    p.copy_(torch.randn(p.shape, generator=g) * p.std())
    sampled, unsampled = mean_thresholds_for("bfloat16")
    check = ParityCheck(prompts=prompts, mean_threshold=sampled, unsampled_mean_threshold=unsampled)
    with pytest.raises(ParityError, match=r"disagree: sampled tokens' mean \|Δlogp\| .* > 0.05 nats.*\[engine\] "
                                          r"dtype"):
        await engine_check(broken, trainer, tiny_model_dir, check)


async def test_confident_broken_engine_fails_the_tail(trainer, prompts, tiny_model_dir) -> None:
    """A sharper LM head in the engine (the tiny model is near uniform, so this is what makes tokens 5+ nats off):
    most tokens fall outside the 2-nat bound, whatever the mean threshold."""
    broken = copy.deepcopy(trainer)
    with torch.no_grad():
        broken.lm_head.weight.mul_(30.0)
    check = ParityCheck(prompts=prompts, mean_threshold=1e3, unsampled_mean_threshold=1e3)  # the tail alone catches it
    with pytest.raises(ParityError, match="of tokens over 2 nats"):
        await engine_check(broken, trainer, tiny_model_dir, check)


def test_one_padded_forward_gives_each_sequence_its_own_logprobs(trainer):
    """The parity check's trainer side runs all its sequences in one right-padded forward (under FSDP every
    forward gathers the whole model): each row's logprobs are those of its own forward."""
    sequences = [((5, 6, 7), tuple(range(100, 140))), ((8,), (9, 10)), ((11, 12, 13, 14, 15), tuple(range(200, 220)))]
    rows = [([*p, *s], [(len(p) - 1 + i, t) for i, t in enumerate(s)]) for p, s in sequences]
    batched = trainer_scores(trainer, rows)
    for (prompt, sampled), logp in zip(sequences, batched):
        alone = trainer_logprobs(trainer, prompt, sampled)
        assert logp.shape == (len(sampled),) and torch.allclose(logp, alone, atol=1e-5), (logp - alone).abs().max()


def tied_copy(model):
    """`model` with its output projection tied to the input embeddings (SmolLM2, Llama 3.2 1B, Qwen 0.5B do that)."""
    tied = copy.deepcopy(model)
    tied.config.tie_word_embeddings = True
    tied.lm_head.weight = tied.model.embed_tokens.weight
    return tied


def entropy_of_samples(model, prompt, sampled) -> float:
    with torch.no_grad():
        logits_TV = model(torch.tensor([[*prompt, *sampled]])).logits[0, len(prompt) - 1:-1]
        logp_TV = logits_TV.log_softmax(-1)
        return -(logp_TV.exp() * logp_TV).sum(-1).mean().item()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
async def test_a_skipped_sync_fails_on_a_confident_policy(trainer, prompts, tiny_model_dir, train_to_answer,
                                                          tied) -> None:
    """A policy trained until it is confident, then a few optimizer steps the engine never receives: its sampled
    tokens show no difference (every one has logprob ~0 on both sides), the prompt, probe and top-k tokens do."""
    tokenizer = load_tokenizer(tiny_model_dir)
    target = tokenizer.encode("<answer>42</answer>", add_special_tokens=False) + [tokenizer.eos_token_id]
    confident = train_to_answer(tied_copy(trainer) if tied else trainer, prompts, target, steps=100)
    moved = train_to_answer(confident, prompts, target, steps=1, lr=1e-5)  # one small step: still confident
    assert (moved.lm_head.weight is moved.model.embed_tokens.weight) == tied
    check = ParityCheck(prompts=prompts, probe=tuple(tokenizer.encode(PROBE_TEXT, add_special_tokens=False)))
    engine = HFPolicy(copy.deepcopy(confident), tokenizer)  # it served `confident`, then missed the sync of `moved`
    try:
        sample = (await engine.generate(prompts[0], SamplingParams(max_tokens=16, seed=0)))[0]
        assert list(sample.token_ids) == target and entropy_of_samples(confident, prompts[0], target) <= 0.02
        assert (await check_parity(engine, confident, check)).kinds["sampled"][1] < 1e-5  # in sync: it passes
        with pytest.raises(ParityError) as missed:
            await check_parity(engine, moved, check)
        print(f"\nmissed sync: {missed.value}")
        failed = str(missed.value)
        assert "sampled tokens'" not in failed  # what the check compared before: blind to the missed sync
        assert "prompt tokens'" in failed and "probe tokens'" in failed and "top-k tokens'" in failed
        await engine.sync_weights(moved, version=1)  # the sync, done: the check passes again
        report = await check_parity(engine, moved, check)
        print(f"after the sync: {report}")
        assert set(report.kinds) == {"sampled", "prompt", "probe", "top-k"} and report.kinds["top-k"][0] >= 100
    finally:
        await engine.close()
