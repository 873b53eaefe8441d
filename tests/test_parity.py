"""The parity gate as a statistic, without vLLM: an in-process engine on a bfloat16 copy of the tiny model passes
against the float32 trainer, a half re-randomized one fails, and the report's numbers are worked out by hand.
(tests/test_vllm.py checks the gate on a real vLLM server.)"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl.models.tokenizer import load_tokenizer
from agentrl.policy.hf import HFPolicy
from agentrl.policy.parity import (ParityCheck, ParityError, ParityReport, batch_trainer_logprobs, check_parity,
                                   compare, mean_threshold_for, trainer_logprobs)
from agentrl.policy.protocol import Sample

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
    assert mean_threshold_for("float32") == 1e-3 and mean_threshold_for("bfloat16") == 5e-2
    assert mean_threshold_for("auto") == 5e-2  # vLLM's "auto" on GPU serves fp16/bf16
    with pytest.raises(ValueError, match="no default parity threshold for dtype 'int8'"):
        mean_threshold_for("int8")
    with pytest.raises(ValueError, match="tail_share"):
        ParityCheck(prompts=((1,),), tail_share=1.0)


def test_report_by_hand(trainer, prompts) -> None:
    """Engine logprobs = the trainer's + known offsets, so every number of the report is known."""
    sampled = [(5, 9, 11, 7), (8, 3)]  # 6 tokens
    offsets = [(0.0, 0.5, -0.5, 3.0), (0.0, -0.1)]
    samples = [Sample(ids, tuple((trainer_logprobs(trainer, p, ids) - torch.tensor(o)).tolist()), "length")
               for p, ids, o in zip(prompts[:2], sampled, offsets)]
    report = compare(trainer, prompts[:2], samples, tail_nats=2.0)
    # |Δ| = 0, .5, .5, 3, 0, .1: mean 4.1 / 6; sorted 0, 0, .1, .5, .5, 3: p50 = (.1 + .5) / 2 = .3 (linear),
    # p99 = .5 + 0.95 * (3 - .5) = 2.875 (position 0.99 * 5 = 4.95); one token of 6 over 2 nats.
    assert report.mean_abs_diff == pytest.approx(4.1 / 6, abs=1e-6)
    assert report.p50_abs_diff == pytest.approx(0.3, abs=1e-6)
    assert report.p99_abs_diff == pytest.approx(2.875, abs=1e-5)
    assert report.max_abs_diff == pytest.approx(3.0, abs=1e-6)
    assert report.tail_share == pytest.approx(1 / 6, abs=1e-7)
    assert (report.num_tokens, report.num_sequences) == (6, 2)
    ratio = (1 + torch.tensor([0.5, -0.5, 3.0, -0.1]).exp().sum().item() + 1) / 6  # exp(logp_trainer - logp_engine)
    assert report.mean_importance_ratio == pytest.approx(ratio, rel=1e-6)
    text = str(report)
    assert "mean 6.83e-01" in text and "p50 3.00e-01" in text and "p99 2.87e+00" in text and "max 3.00e+00" in text
    assert "16.7% of tokens over 2 nats" in text


def test_gate_mean_and_tail() -> None:
    base = ParityReport(mean_abs_diff=0.02, p50_abs_diff=0.01, p99_abs_diff=0.5, max_abs_diff=1.5, tail_share=0.0,
                        tail_nats=2.0, mean_importance_ratio=1.0, num_tokens=200, num_sequences=4)
    bf16 = ParityCheck(prompts=((1,),), mean_threshold=mean_threshold_for("bfloat16"))
    assert bf16.failures(base) == []  # bf16 kernel noise: a max of 1.5 nats is no longer an error
    assert ParityCheck(prompts=((1,),)).failures(base) == ["mean |Δlogp| 2.00e-02 > 0.001 nats"]  # float32
    # 3 of 200 tokens 2.5 nats off, the rest exact: the mean (0.0375) passes, the tail (1.5 % > 1 %) does not
    tail = replace(base, mean_abs_diff=3 * 2.5 / 200, max_abs_diff=2.5, tail_share=3 / 200)
    assert bf16.failures(tail) == ["1.5% of tokens over 2 nats (at most 1.0%)"]


async def test_bf16_engine_passes_against_fp32_trainer(trainer, prompts, tiny_model_dir) -> None:
    check = ParityCheck(prompts=prompts, mean_threshold=mean_threshold_for("bfloat16"))
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
    check = ParityCheck(prompts=prompts, mean_threshold=mean_threshold_for("bfloat16"))
    with pytest.raises(ParityError, match=r"disagree: mean \|Δlogp\| .* > 0.05 nats .*\[engine\] dtype"):
        await engine_check(broken, trainer, tiny_model_dir, check)


async def test_confident_broken_engine_fails_the_tail(trainer, prompts, tiny_model_dir) -> None:
    """A sharper LM head in the engine (the tiny model is near uniform, so this is what makes tokens 5+ nats off):
    most tokens fall outside the 2-nat bound, whatever the mean threshold."""
    broken = copy.deepcopy(trainer)
    with torch.no_grad():
        broken.lm_head.weight.mul_(30.0)
    check = ParityCheck(prompts=prompts, mean_threshold=1e3)  # the mean gate off: the tail alone catches it
    with pytest.raises(ParityError, match="of tokens over 2 nats"):
        await engine_check(broken, trainer, tiny_model_dir, check)


def test_one_padded_forward_gives_each_sequence_its_own_logprobs(trainer):
    """The parity check's trainer side runs all its sequences in one right-padded forward (under FSDP every
    forward gathers the whole model): each row's logprobs are those of its own forward."""
    sequences = [((5, 6, 7), tuple(range(100, 140))), ((8,), (9, 10)), ((11, 12, 13, 14, 15), tuple(range(200, 220)))]
    batched = batch_trainer_logprobs(trainer, sequences)
    for (prompt, sampled), logp in zip(sequences, batched):
        alone = trainer_logprobs(trainer, prompt, sampled)
        assert logp.shape == (len(sampled),) and torch.allclose(logp, alone, atol=1e-5), (logp - alone).abs().max()
