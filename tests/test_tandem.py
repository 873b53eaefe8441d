"""Tandem rollouts: unit boundaries, who wrote what, masks exactly on the senior's tokens, ids verbatim."""

import asyncio
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl.envs.math import ArithmeticEnv
from agentrl.policy.hf import HFPolicy
from agentrl.policy.protocol import Sample, SamplingParams
from agentrl.renderer import Renderer
from agentrl.rollout.engine import RolloutConfig, RolloutEngine
from agentrl.models.tokenizer import load_tokenizer
from agentrl.trainers.batch import make_batch
from agentrl.policy.logprobs import token_logprobs
from agentrl.trainers.methods.tandem import TandemPolicy, junior_cross_entropy, unit_end

EOS = 0
TEXT = {EOS: "<eos>", 10: " s", 11: "s", 20: " j", 21: "j"}  # senior / junior: word starts and continuations


class Tokenizer:
    def decode(self, ids):
        return "".join(TEXT[i] for i in ids)


class Writer:
    """Writes words of 3 tokens (a word start at every absolute position divisible by 3) and stops at
    position 40; logprob -1 (senior) or -2 (junior). Records every request and what it returned."""

    weight_version = 0

    def __init__(self, start, logprob):
        self.start, self.logprob, self.calls = start, logprob, []

    async def generate(self, prompt_ids, sampling: SamplingParams):
        ids, finish = [], "length"
        for pos in range(len(prompt_ids), len(prompt_ids) + sampling.max_tokens):
            if pos >= 40:
                ids.append(EOS)
                finish = "stop"
                break
            ids.append(self.start if pos % 3 == 0 else self.start + 1)
        self.calls.append((tuple(prompt_ids), tuple(ids)))
        return [Sample(tuple(ids), (self.logprob,) * len(ids), finish)]


def tandem(**kw):
    senior, junior = Writer(10, -1.0), Writer(20, -2.0)
    return TandemPolicy(senior, junior, Tokenizer(), **kw), senior, junior


def sample(policy, seed=7, max_tokens=64):
    return asyncio.run(policy.generate([1, 2], SamplingParams(max_tokens=max_tokens, seed=seed)))[0]


def test_unit_boundaries():
    assert unit_end([" a", "b", " c"], "word", 0) == 2
    assert unit_end([" a", "b"], "word", 0) is None  # the word may go on
    assert unit_end([" x", "y"], "word", 3) == 0  # the unit already holds a word: it ended before " x"
    assert unit_end(["\n", "a"], "word", 1) == 0  # newlines start units too
    assert unit_end(["a", ".", "b"], "sentence", 0) == 2
    assert unit_end(["x\n"], "sentence", 5) == 1
    assert unit_end(["a", "b"], "sentence", 0) is None
    assert unit_end(["a", "b"], "token", 0) == 1


def test_masks_cover_exactly_the_seniors_tokens_and_ids_stay_verbatim():
    policy, senior, junior = tandem(p_junior=0.5, lookahead=4)
    out = sample(policy)
    ids, writers = list(out.token_ids), [TEXT[i] for i in out.token_ids]
    assert out.finish_reason == "stop" and ids[-1] == EOS and len(ids) == 39  # positions 2..39 and the EOS
    body = ids[:-1]
    assert out.trainable[:-1] == tuple(int(i in (10, 11)) for i in body)
    assert out.logprobs[:-1] == tuple(-1.0 if i in (10, 11) else -2.0 for i in body)
    assert 0 < sum(out.trainable[:-1]) < len(body)  # both wrote
    for i in range(1, len(body)):  # the writer changes only where a word starts
        if (body[i] in (10, 11)) != (body[i - 1] in (10, 11)):
            assert writers[i].startswith(" ")
    # every request continued exactly the ids kept so far, and what was kept is a prefix of what came back
    calls = sorted(senior.calls + junior.calls, key=lambda c: len(c[0]))
    for (prompt, returned), nxt in zip(calls, calls[1:] + [((1, 2, *ids), ())]):
        assert prompt == (1, 2, *ids[:len(prompt) - 2])
        kept = len(nxt[0]) - len(prompt)
        assert tuple(ids[len(prompt) - 2:len(prompt) - 2 + kept]) == returned[:kept]
    assert sample(tandem(p_junior=0.5, lookahead=4)[0]) == out  # seeded: reproducible


def test_solo_takeover_and_all_junior_schedules():
    assert set(sample(tandem(p_junior=0.0)[0]).trainable) == {1}
    all_junior = sample(tandem(p_junior=1.0)[0])
    assert set(all_junior.trainable) == {0} and set(all_junior.token_ids) <= {20, 21, EOS}
    takeover = sample(tandem(p_junior=0.0, junior_after=2)[0])
    # words start at positions 3, 6, ...; the senior writes "ss" (positions 2 and the end of the prompt's
    # word) then two more units: units are [2], [3,4,5], then the junior from position 6 on
    assert takeover.token_ids[:4] == (11, 10, 11, 11) and set(takeover.trainable[:4]) == {1}
    assert set(takeover.token_ids[4:-1]) == {20, 21} and set(takeover.trainable[4:]) == {0}
    assert sample(tandem(p_junior=0.0)[0], max_tokens=5).finish_reason == "length"


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    """The tiny model as senior, and a perturbed copy as junior: two different distributions."""
    senior = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    junior = copy.deepcopy(senior)
    with torch.no_grad():
        for p in junior.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
    return senior, junior, load_tokenizer(tiny_model_dir)


@pytest.mark.slow
def test_tandem_episodes_train_only_on_the_seniors_tokens(pair):
    senior, junior, tokenizer = pair
    renderer = Renderer(tokenizer)
    policy = TandemPolicy(HFPolicy(senior, tokenizer), HFPolicy(junior, tokenizer), tokenizer, "token", 0.5)
    cfg = RolloutConfig(group_size=2, max_total_tokens=1024, sampling=SamplingParams(max_tokens=24))
    engine = RolloutEngine(lambda: ArithmeticEnv(n_tasks=4), policy, renderer, cfg)
    groups = asyncio.run(engine.run(list(ArithmeticEnv(n_tasks=4).tasks)))
    engine.close()
    trajectories = [t for g in groups for t in g.trajectories]
    batch = make_batch(trajectories)
    with torch.no_grad():
        logp = {name: token_logprobs(m, batch.ids_BT, batch.attention_BT)[0] for name, m in
                (("senior", senior), ("junior", junior))}
    counts = {"senior": 0, "junior": 0}
    for b, t in enumerate(trajectories):
        assert t.status.value != "error", t.reason
        spans = [i for turn in t.turns for i in range(turn.start, turn.end)]
        assert all(t.loss_mask[i] == 0 for i in range(len(t.token_ids)) if i not in spans)
        for i in spans:  # each sampled token's logprob is its writer's, and the mask is 1 iff that is the senior
            writer = "senior" if t.loss_mask[i] else "junior"
            assert t.logprobs[i] == pytest.approx(logp[writer][b, i].item(), abs=1e-4)
            counts[writer] += 1
        assert t.metrics.get("untrained_tokens", 0) == sum(1 for i in spans if not t.loss_mask[i])
    assert counts["senior"] > 10 and counts["junior"] > 10


def test_junior_cross_entropy_is_the_mean_nll_of_the_seniors_tokens(pair):
    senior, _, tokenizer = pair
    renderer = Renderer(tokenizer)
    cfg = RolloutConfig(group_size=2, max_total_tokens=1024, sampling=SamplingParams(max_tokens=16))
    engine = RolloutEngine(lambda: ArithmeticEnv(n_tasks=2), HFPolicy(senior, tokenizer), renderer, cfg)
    trajectories = [t for g in asyncio.run(engine.run(list(ArithmeticEnv(n_tasks=2).tasks))) for t in g.trajectories]
    engine.close()
    sampled = [lp for t in trajectories for lp, m in zip(t.logprobs, t.loss_mask) if m]
    assert junior_cross_entropy(senior, trajectories, batch_size=3) == pytest.approx(-sum(sampled) / len(sampled),
                                                                                       abs=1e-4)
