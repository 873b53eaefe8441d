"""HFPolicy: batched in-process sampling whose ids and logprobs are exactly what the trainer recomputes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import agentrl.policy.hf as hf
from agentrl.policy.hf import HFPolicy
from agentrl.policy.protocol import MAX_SEED, Policy, PolicyError, Sample, SamplingParams
from agentrl.models.tokenizer import load_tokenizer

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), load_tokenizer(tiny_model_dir)


@pytest.fixture
async def policy(model_and_tokenizer):
    policy = HFPolicy(*model_and_tokenizer, max_batch_size=64)
    yield policy
    await policy.close()


@pytest.fixture
def prompts(model_and_tokenizer) -> list[list[int]]:
    """Chat prompts of different lengths, so batches are left-padded."""
    tok = model_and_tokenizer[1]
    questions = ["What is 3 * (4 + 5)?", "Hi", "Find the capital of Velkamor, then compute 12 + 30. " * 3]
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in questions]
    return [tok.encode(text, add_special_tokens=False) for text in texts]


def forward_logprobs(model, prompt: list[int], sampled: tuple[int, ...]) -> torch.Tensor:
    """What a trainer computes: log p(sampled[i] | prompt + sampled[:i]) from one full forward pass."""
    ids_T = torch.tensor(prompt + list(sampled))
    with torch.no_grad():
        logp_TV = model(ids_T[None]).logits[0].float().log_softmax(-1)
    return logp_TV[len(prompt) - 1 : -1].gather(1, torch.tensor(sampled)[:, None]).squeeze(1)


async def test_is_a_policy(policy: HFPolicy) -> None:
    assert isinstance(policy, Policy)


async def test_returns_n_samples_within_max_tokens(policy: HFPolicy, prompts: list[list[int]]) -> None:
    samples = await policy.generate(prompts[0], SamplingParams(max_tokens=8, n=4, seed=1))
    assert len(samples) == 4 and all(isinstance(s, Sample) for s in samples)
    for s in samples:
        assert 1 <= len(s.token_ids) <= 8 and len(s.logprobs) == len(s.token_ids)
        if s.finish_reason == "length":
            assert len(s.token_ids) == 8
        else:
            assert s.finish_reason == "stop" and s.token_ids[-1] in policy.eos_ids
    assert len({s.token_ids for s in samples}) > 1  # different seeds per sample


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_tokens=20, n=2, seed=0),
    SamplingParams(max_tokens=20, n=2, seed=1, temperature=0.7, top_p=0.9, top_k=50),
    SamplingParams(max_tokens=20, temperature=0.0),
])
async def test_logprobs_equal_a_full_forward_pass(policy: HFPolicy, prompts, model_and_tokenizer, sampling) -> None:
    model = model_and_tokenizer[0]
    results = await asyncio.gather(*(policy.generate(p, sampling) for p in prompts))  # one padded batch
    for prompt, samples in zip(prompts, results):
        for s in samples:
            expected = forward_logprobs(model, prompt, s.token_ids)
            torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-4, rtol=0)


async def test_greedy_is_deterministic_and_is_the_argmax(policy: HFPolicy, prompts, model_and_tokenizer) -> None:
    model = model_and_tokenizer[0]
    first = await policy.generate(prompts[0], SamplingParams(max_tokens=24, temperature=0.0, n=3))
    second = await policy.generate(prompts[0], GREEDY)
    assert first[0].token_ids == first[1].token_ids == first[2].token_ids == second[0].token_ids
    ids_T = torch.tensor(prompts[0] + list(second[0].token_ids))
    with torch.no_grad():
        argmax_T = model(ids_T[None]).logits[0].argmax(-1)
    assert tuple(argmax_T[len(prompts[0]) - 1 : -1].tolist()) == second[0].token_ids


async def test_seeded_request_is_independent_of_its_batch(policy: HFPolicy, prompts) -> None:
    target = SamplingParams(max_tokens=32, n=2, seed=1234, temperature=0.9, top_p=0.95)
    alone = await policy.generate(prompts[0], target)
    others = [policy.generate(prompts[i % 3], SamplingParams(max_tokens=8 + i * 3, seed=i, n=1 + i % 2))
              for i in range(15)]
    batched, *_ = await asyncio.gather(policy.generate(prompts[0], target), *others)
    assert [s.token_ids for s in batched] == [s.token_ids for s in alone]
    torch.testing.assert_close(torch.tensor([s.logprobs for s in batched]), torch.tensor([s.logprobs for s in alone]),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature, top_k, expected", [
    (1.0, 0, [0.5, 0.25, 0.15, 0.1]),
    (0.5, 0, [0.25 / 0.345, 0.0625 / 0.345, 0.0225 / 0.345, 0.01 / 0.345]),  # p^2, renormalized
    (1.0, 2, [2 / 3, 1 / 3, 0.0, 0.0]),
])
def test_sampled_tokens_follow_the_tempered_and_truncated_probabilities(temperature, top_k, expected) -> None:
    """20,000 rows of the same logits, each with its own seeded generator (as a batch's rows are): each token's
    frequency within 4 standard errors of its probability."""
    n = 20_000
    logits_BV = torch.tensor([0.5, 0.25, 0.15, 0.1]).log().expand(n, 4).contiguous()
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    tokens_B, logps_B = hf._sample(logits_BV, torch.full((n,), temperature), torch.ones(n),
                                   torch.full((n,), top_k), gens)
    frequency = torch.bincount(tokens_B, minlength=4).double() / n
    expected_V = torch.tensor(expected, dtype=torch.double)
    assert ((frequency - expected_V).abs() <= 4 * (expected_V * (1 - expected_V) / n).sqrt()).all(), frequency
    torch.testing.assert_close(logps_B, logits_BV.log_softmax(-1).gather(1, tokens_B[:, None]).squeeze(1))


async def test_the_largest_seed_samples_and_a_larger_one_is_refused(policy: HFPolicy, prompts) -> None:
    """A seed past what the engines take (signed 64 bits, less the n samples' offsets) would fail a whole batch."""
    assert await policy.generate(prompts[0], SamplingParams(max_tokens=4, n=2, seed=MAX_SEED))
    with pytest.raises(ValueError, match="seed must be in"):
        SamplingParams(seed=MAX_SEED + 1)
    with pytest.raises(ValueError, match="seed must be in"):
        SamplingParams(seed=-1)


async def test_stop_token_ids_stop_and_are_kept(policy: HFPolicy, prompts) -> None:
    (full,) = await policy.generate(prompts[0], GREEDY)
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    (s,) = await policy.generate(prompts[0], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(stop_id,)))
    assert s.token_ids == full.token_ids[: first + 1] and s.finish_reason == "stop"


async def test_stop_strings_stop_at_the_completing_token(policy: HFPolicy, prompts, model_and_tokenizer) -> None:
    tok = model_and_tokenizer[1]
    (full,) = await policy.generate(prompts[0], GREEDY)
    text = tok.decode(full.token_ids[4:8])
    stop = text[1:-1] if len(text) > 3 else text  # likely spans token boundaries
    # The first prefix whose text contains the stop string ends the sample.
    end = next(j for j in range(1, len(full.token_ids) + 1) if stop in tok.decode(full.token_ids[:j]))
    (s,) = await policy.generate(prompts[0], SamplingParams(max_tokens=24, temperature=0.0, stop=(stop, "\x00never")))
    assert s.token_ids == full.token_ids[:end] and s.finish_reason == "stop"
    assert stop in tok.decode(s.token_ids) and stop not in tok.decode(s.token_ids[:-1])


async def test_max_tokens_gives_finish_reason_length(policy: HFPolicy, prompts) -> None:
    (full,) = await policy.generate(prompts[1], GREEDY)
    assert not set(full.token_ids[:5]) & policy.eos_ids
    (s,) = await policy.generate(prompts[1], SamplingParams(max_tokens=5, temperature=0.0))
    assert s.token_ids == full.token_ids[:5] and s.finish_reason == "length"


async def test_context_limit(policy: HFPolicy, prompts) -> None:
    max_len = policy.max_len
    with pytest.raises(PolicyError, match="context"):
        await policy.generate([5] * max_len, GREEDY)
    with pytest.raises(PolicyError, match="empty"):
        await policy.generate([], GREEDY)
    with pytest.raises(PolicyError, match="vocabulary"):
        await policy.generate([policy.vocab_size], GREEDY)
    # A prompt that nearly fills the context ends at the context with "length"; the policy keeps serving.
    (s,) = await policy.generate([5] * (max_len - 3), SamplingParams(max_tokens=50, temperature=0.0))
    assert len(s.token_ids) <= 3 and (s.finish_reason == "length") == (len(s.token_ids) == 3)
    assert len(await policy.generate(prompts[0], GREEDY)) == 1


async def test_close_fails_requests_in_flight(policy: HFPolicy, prompts) -> None:
    running = asyncio.create_task(policy.generate(prompts[0], SamplingParams(max_tokens=64, seed=0)))
    await asyncio.sleep(0.05)  # the worker has taken it into a round
    await policy.close()
    with pytest.raises(PolicyError, match="closed"):
        await running


async def test_closed_policy_refuses(policy: HFPolicy, prompts) -> None:
    await policy.close()
    await policy.close()  # idempotent
    with pytest.raises(PolicyError, match="closed"):
        await policy.generate(prompts[0], GREEDY)


async def test_shared_prefix_batch_matches_a_full_forward_pass(policy: HFPolicy, model_and_tokenizer) -> None:
    """Rows sharing a long system prompt reuse its KV; their logprobs must not change because of it."""
    model, tok = model_and_tokenizer
    system = {"role": "system", "content": "You are a careful assistant who uses tools. " * 8}
    prompts = [tok.apply_chat_template([system, {"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=False) for q in ["Hi", "What is 2 + 2?", "Name three colours, please."]]
    ids = [tok.encode(t, add_special_tokens=False) for t in prompts]
    sampling = SamplingParams(max_tokens=16, seed=5)
    alone = [await policy.generate(p, sampling) for p in ids]
    batched = await asyncio.gather(*(policy.generate(p, sampling) for p in ids))
    for prompt, [one], [many] in zip(ids, alone, batched):
        assert many.token_ids == one.token_ids
        torch.testing.assert_close(torch.tensor(many.logprobs), forward_logprobs(model, prompt, many.token_ids),
                                   atol=1e-4, rtol=0)


async def test_requests_that_arrive_spread_out_share_one_batch(policy: HFPolicy, prompts, monkeypatch) -> None:
    """An idle worker waits while requests keep arriving (agents behind the gateway send theirs a few ms apart):
    eight calls 20 ms apart are one batch of 8, not a batch of 1 that the other seven wait out. The quiet window is
    widened here so that a slow machine cannot split them; a call alone still starts after one window."""
    monkeypatch.setattr(hf, "GATHER_QUIET_S", 0.2)
    monkeypatch.setattr(hf, "GATHER_MAX_S", 5.0)
    batches: list[int] = []
    decode = policy._decode
    policy._decode = lambda rows: batches.append(len(rows)) or decode(rows)

    async def call(i: int) -> list[Sample]:
        await asyncio.sleep(0.02 * i)
        return await policy.generate(prompts[i % len(prompts)], SamplingParams(max_tokens=4, seed=i))

    assert len(await asyncio.gather(*(call(i) for i in range(8)))) == 8
    assert batches == [8]
    await policy.generate(prompts[0], SamplingParams(max_tokens=4, seed=9))
    assert batches == [8, 1]
