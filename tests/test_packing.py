"""Packed rows and token-balanced micro-batches change how the work is cut, never the numbers: packed logprobs,
entropies and gradients equal the padded pass's (float64: to ~1e-12), and a step cut into micro-batches by a token
budget accumulates the whole minibatch's gradient, sharded or not."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl.trainers import distributed
from agentrl.policy.logprobs import pack_plan, token_logprobs
from agentrl.trainers.batch import Batch, make_batch, token_micro_batches
from agentrl.trainers.loop import LoopConfig, optimize
from agentrl.trainers.losses import POLICY_LOSSES, PolicyLossConfig
from agentrl.types import Trajectory, Turn


def traj(ids, mask, logprobs=None):
    n = len(ids)
    return Trajectory("t", tuple(ids), tuple(mask), tuple(logprobs or (0.0,) * n), 2, (Turn(2, n, n),), 1.0)


def episodes(prefix: int = 0, seed: int = 0):
    """Six multi-turn rows of 9 to 46 tokens (after a common `prefix`): two or three sampled turns between
    observations, one row with every token sampled, one with none, and one that ends in an observation."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(10, 4000, (prefix,), generator=g).tolist()
    shapes = ((3, 5, 4, 9, 2, 6), (8, 12, 6, 20), (1, 3, 2, 3), (0, 30), (25,), (2, 11, 7, 9, 3))  # obs, sampled, ...
    rows, masks = [], []
    for i, spans in enumerate(shapes):
        if i == 3:
            mask = [1] * 30  # every token sampled (position 0 is never predicted)
        elif i == 4:
            mask = [0] * 25  # nothing sampled
        else:
            mask = [m for k, n in enumerate(spans) for m in [k % 2] * n]
        rows.append(shared + torch.randint(10, 4000, (len(mask),), generator=g).tolist())
        masks.append([0] * prefix + mask)
    advantages = torch.randn(len(rows), generator=g).tolist()
    return make_batch([traj(r, m, (-1.0,) * len(r)) for r, m in zip(rows, masks)], advantages)


def passes(model):
    """The base model's calls as (shape, packed?): packed calls give position_ids and no attention mask."""
    seen, forward = [], model.base_model.forward

    def spy(*args, **kw):
        seen.append((tuple(kw["input_ids"].shape), kw.get("attention_mask") is None and "position_ids" in kw))
        return forward(*args, **kw)

    model.base_model.forward = spy
    return seen


def logprobs_and_grads(model, b, **kw):
    model.zero_grad()
    logp_BT, entropy_BT = token_logprobs(model, b.ids_BT, b.attention_BT, True, b.mask_BT, **kw)
    (logp_BT * b.adv_BT).sum().backward()
    return logp_BT.detach(), entropy_BT, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a, b, tol):
    (lp0, e0, g0), (lp, e, g) = a, b
    torch.testing.assert_close(lp, lp0, atol=tol, rtol=0)
    torch.testing.assert_close(e, e0, atol=tol, rtol=0)
    assert g.keys() == g0.keys() and g0
    for name in g0:
        assert (g[name] - g0[name]).abs().max() <= tol * max(1.0, g0[name].abs().max()), name


@pytest.mark.parametrize("budget", [None, 1, 16, 40, 61, 500])  # 1 and 16: rows longer than the budget go alone
def test_packed_logprobs_entropy_and_gradients_equal_the_padded_pass(tiny_model_dir, budget):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    b = episodes()
    seen = passes(model)
    padded = logprobs_and_grads(model, b, pack=False)
    packed = logprobs_and_grads(model, b, pack=True, pack_tokens=budget)
    assert seen[0] == (tuple(b.ids_BT.shape), False) and seen[1][1], seen  # the padded pass, then a packed one
    assert_same(padded, packed, 1e-10)
    assert ((packed[0] != 0)[:, 1:] == (b.mask_BT > 0)[:, 1:]).all()  # a logprob on every sampled token, 0 elsewhere
    assert (packed[0][:, 0] == 0).all() and (packed[0][4] == 0).all()


def test_packing_in_float32_and_in_eval_without_grad(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    b = episodes()
    assert_same(logprobs_and_grads(model, b, pack=False), logprobs_and_grads(model, b, pack=True), 1e-5)
    with torch.no_grad():
        lp, e = token_logprobs(model, b.ids_BT, b.attention_BT, True, b.mask_BT, pack=True)
        lp0, e0 = token_logprobs(model, b.ids_BT, b.attention_BT, True, b.mask_BT, pack=False)
    torch.testing.assert_close(lp, lp0, atol=1e-5, rtol=0)
    torch.testing.assert_close(e, e0, atol=1e-5, rtol=0)


def test_eager_attention_keeps_packed_rows_apart(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64, attn_implementation="eager")
    b = episodes()
    assert_same(logprobs_and_grads(model, b, pack=False), logprobs_and_grads(model, b, pack=True, pack_tokens=40),
                1e-10)


def test_lora_model_packs(tiny_model_dir):
    pytest.importorskip("peft")
    from agentrl.trainers.lora import LoraSettings, add_lora

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    add_lora(model, LoraSettings(r=4))
    for module in model.modules():  # B starts at 0: give the adapters a part in the logprobs
        if hasattr(module, "lora_B"):
            torch.nn.init.normal_(module.lora_B["default"].weight, std=0.1)
    b = episodes()
    padded, packed = logprobs_and_grads(model, b, pack=False), logprobs_and_grads(model, b, pack=True)
    assert all("lora_" in n for n in padded[2])  # only the adapters train
    assert_same(padded, packed, 1e-10)


def test_shared_prefix_or_packing_whichever_runs_fewer_tokens(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    seen = passes(model)
    long_prefix = episodes(prefix=200)  # the prefix pass runs 199 + 6 x 47 tokens, packing 5 bins of 245
    ref = logprobs_and_grads(model, long_prefix, pack=False)
    seen.clear()
    assert_same(ref, logprobs_and_grads(model, long_prefix), 0.0)
    assert [packed for _, packed in seen] == [False, False] and seen[0][0] == (1, 199)  # the prefix, then the rest
    # Packing the whole rows instead: the same logprobs, and gradients within 1e-6 of each tensor's largest. (The
    # prefix pass's own gradients differ from the padded pass's by ~1e-8 of the largest even in float64, which
    # packing's do not: see tests/test_logprobs_memory.py.)
    assert_same(ref, logprobs_and_grads(model, long_prefix, pack=True), 1e-6)

    # A 40-token prompt, then one long answer and three short ones: the prefix pass runs 39 + 4 x 151 tokens,
    # packing two bins of 189.
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(10, 4000, (40,), generator=g).tolist()
    short_prefix = make_batch([traj(prompt + torch.randint(10, 4000, (n,), generator=g).tolist(), [0] * 40 + [1] * n)
                               for n in (150, 5, 5, 5)], [1.0, -1.0, 0.5, 0.2])
    seen.clear()
    packed = logprobs_and_grads(model, short_prefix)
    assert len(seen) == 1 and seen[0][1], seen
    assert_same(logprobs_and_grads(model, short_prefix, pack=False), packed, 1e-6)  # pack=False: the prefix pass


def test_equal_rows_are_not_packed_and_empty_masks_keep_the_graph(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    g = torch.Generator().manual_seed(3)
    b = make_batch([traj(torch.randint(10, 4000, (20,), generator=g).tolist(), [0] * 5 + [1] * 15)
                    for _ in range(4)], [1.0] * 4)
    seen = passes(model)
    token_logprobs(model, b.ids_BT, b.attention_BT, mask_BT=b.mask_BT)
    assert seen == [((4, 20), False)]  # nothing to save: the padded pass, bit for bit today's numbers
    logp_BT, _ = token_logprobs(model, b.ids_BT, b.attention_BT, mask_BT=torch.zeros_like(b.mask_BT), pack=True)
    assert logp_BT.abs().max() == 0 and logp_BT.requires_grad  # a weight-0 pass can still run its backward
    model.config._attn_implementation = "made_up"
    with pytest.raises(ValueError, match="keeps packed rows apart"):
        token_logprobs(model, b.ids_BT, b.attention_BT, mask_BT=b.mask_BT, pack=True)


def test_pack_plan_first_fit_decreasing():
    mask_BT = torch.zeros(5, 12)
    for b, last in enumerate((11, 3, 7, 0, 4)):  # row 3 has nothing to predict
        mask_BT[b, last] = 1
    plan = pack_plan(mask_BT)  # budget: the longest row, 11 tokens
    assert plan.length_B.tolist() == [11, 3, 7, 0, 4]
    assert plan.bin_B.tolist() == [0, 2, 1, -1, 1] and plan.offset_B.tolist() == [0, 0, 0, 0, 7]  # 11 | 7 4 | 3
    assert plan.positions_KW.tolist() == [list(range(11)), list(range(7)) + list(range(4)), list(range(3)) + list(range(8))]
    alone = pack_plan(mask_BT, budget=5)  # the rows longer than 5 go alone; 4 and 3 do not fit together
    assert alone.bin_B.tolist() == [0, 3, 1, -1, 2] and alone.positions_KW.shape == (4, 11)
    assert pack_plan(torch.zeros(2, 4)) is None
    with pytest.raises(ValueError, match="pack_tokens"):
        pack_plan(mask_BT, budget=0)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_token_micro_batches_stay_within_budget_on_every_rank(world):
    g = torch.Generator().manual_seed(world)
    lengths_R = torch.randint(5, 300, (23,), generator=g)
    rows = torch.randperm(100, generator=g)[:23]
    for budget in (1, 200, 600, 10_000):
        groups = token_micro_batches(rows, lengths_R, budget, world)
        assert sorted(torch.cat(groups).tolist()) == sorted(rows.tolist())  # each row once
        length = dict(zip(rows.tolist(), lengths_R.tolist()))
        for group in groups:
            for r in range(world):
                share = [length[i] for i in group[r::world].tolist()]
                assert not share or len(share) * max(share) <= max(budget, max(share))  # a longer row goes alone
        assert all(len(g) >= world for g in groups[:-1])  # every rank has rows in every pass but maybe the last
    assert len(token_micro_batches(rows, lengths_R, 10 ** 9, world)) == 1


def rl_batch(seed=0):
    b = episodes(seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    return type(b)(b.ids_BT, b.attention_BT, b.mask_BT, (b.old_logp_BT - 0.1 * torch.rand(b.mask_BT.shape, generator=g))
                   * b.mask_BT, b.adv_BT)


def step_gradients(model, batch, cfg, agg, monkeypatch, rank=0, world=1):
    """The gradients of one optimize step over the whole batch (lr 0: the weights stay), and the passes it ran."""
    monkeypatch.setattr(distributed, "current", lambda: distributed.Ranks(rank, world))
    sizes, loss_fn = [], POLICY_LOSSES["ppo"]

    def policy_loss(mb, rows):
        sizes.append(len(rows))
        logp_BT, _ = token_logprobs(model, mb.ids_BT, mb.attention_BT, mask_BT=mb.mask_BT)
        return loss_fn(logp_BT, mb.old_logp_BT, mb.adv_BT, mb.mask_BT, PolicyLossConfig(agg=agg))

    optimize(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, cfg, torch.Generator().manual_seed(0),
             policy_loss, agg)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, sizes


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_token_balanced_micro_batches_accumulate_the_whole_minibatch_gradient(tiny_model_dir, monkeypatch, agg):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    batch = rl_batch()
    whole = LoopConfig(minibatch_size=len(batch), max_grad_norm=1e9)
    g0, sizes = step_gradients(model, batch, whole, agg, monkeypatch)
    assert sizes == [6]
    for tokens in (1, 70, 130):
        g, sizes = step_gradients(model, batch, LoopConfig(minibatch_size=6, max_grad_norm=1e9,
                                                           micro_batch_tokens=tokens), agg, monkeypatch)
        assert len(sizes) > 1 and sum(sizes) == 6
        for name in g0:
            torch.testing.assert_close(g[name], g0[name], atol=1e-10, rtol=1e-9)
        # Sharded over 2 ranks: the same number of passes on each, and FSDP's mean of their gradients is the step's.
        ranks = [step_gradients(model, batch, LoopConfig(minibatch_size=6, max_grad_norm=1e9, micro_batch_tokens=tokens),
                                agg, monkeypatch, rank, 2) for rank in (0, 1)]
        assert len(ranks[0][1]) == len(ranks[1][1])
        for name in g0:
            torch.testing.assert_close((ranks[0][0][name] + ranks[1][0][name]) / 2, g0[name], atol=1e-10, rtol=1e-9)


def test_micro_batch_tokens_is_validated():
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        LoopConfig(micro_batch_tokens=0)
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        LoopConfig(micro_batch_tokens=1024, micro_batch_size=2)


def test_the_passes_without_gradients_keep_the_token_budget():
    """PPO's values and decoupled PPO's old logprobs run over the whole step's batch in the update's passes: a
    minibatch's worth at most, within `micro_batch_tokens` (a longer row alone)."""
    from agentrl.trainers.methods.grpo import GRPOConfig
    from agentrl.trainers.loop import no_grad_passes

    lengths = [30, 5, 12, 30, 8, 25, 3]
    attention = torch.zeros(len(lengths), 30, dtype=torch.long)
    for i, n in enumerate(lengths):
        attention[i, :n] = 1
    batch = Batch(attention.clone(), attention, attention.float(), torch.zeros(attention.shape), torch.zeros(attention.shape))
    cfg = GRPOConfig(minibatch_size=4, micro_batch_tokens=32)
    passes = no_grad_passes(cfg, batch)
    assert sorted(torch.cat(passes).tolist()) == list(range(len(lengths)))  # every row once
    assert all(len(p) * max(lengths[i] for i in p.tolist()) <= 32 or len(p) == 1 for p in passes)
    assert all(set(p.tolist()) <= set(range(4)) or set(p.tolist()) <= set(range(4, 7)) for p in passes)
