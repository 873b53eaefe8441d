"""Training tensors from trajectories, and the trainer's logprobs (with and without prefix sharing)."""

import torch
from transformers import AutoModelForCausalLM

from agentrl.trainers.batch import make_batch
from agentrl.policy.logprobs import token_logprobs
from agentrl.types import Trajectory, Turn


def traj(ids, mask, logprobs=None):
    n = len(ids)
    return Trajectory("t", tuple(ids), tuple(mask), tuple(logprobs or [0.0] * n), 2, (Turn(2, n, n),), 1.0)


def test_make_batch_pads_and_masks_advantages():
    b = make_batch([traj([5, 6, 7, 8], [0, 0, 1, 1], [0, 0, -1.0, -2.0]), traj([5, 6, 9], [0, 0, 1])], [2.0, [0, 0, -1.0]])
    assert b.ids_BT.tolist() == [[5, 6, 7, 8], [5, 6, 9, 0]]
    assert b.attention_BT.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert b.mask_BT.tolist() == [[0, 0, 1, 1], [0, 0, 1, 0]]
    assert b.adv_BT.tolist() == [[0, 0, 2.0, 2.0], [0, 0, -1.0, 0]]
    assert b.old_logp_BT.tolist() == [[0, 0, -1.0, -2.0], [0, 0, 0, 0]]
    assert b.select(torch.tensor([1])).ids_BT.tolist() == [[5, 6, 9]]  # trimmed to its length


def test_shared_prefix_gives_the_same_logprobs_and_gradients(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(10, 4000, (40,), generator=g).tolist()
    rows = [prefix + torch.randint(10, 4000, (n,), generator=g).tolist() for n in (12, 20, 7)]
    trajectories = [traj(r, [0] * 43 + [1] * (len(r) - 43)) for r in rows]
    b = make_batch(trajectories, [1.0, -1.0, 0.5])
    results = []
    for share in (False, True):
        model.zero_grad()
        logp_BT, ent_BT = token_logprobs(model, b.ids_BT, b.attention_BT, True, b.mask_BT if share else None)
        (logp_BT * b.mask_BT * b.adv_BT).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        results.append((logp_BT * b.mask_BT, ent_BT * b.mask_BT, grads))
    (lp0, e0, g0), (lp1, e1, g1) = results
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=0)
    torch.testing.assert_close(e1, e0, atol=1e-5, rtol=0)
    for a, c in zip(g0, g1):
        torch.testing.assert_close(c, a, atol=1e-5, rtol=1e-4)
    assert (lp0 != 0).sum() == b.mask_BT.sum()  # every trained position has a logprob


def test_masked_positions_only_match_the_full_forward_without_a_shared_prefix(tiny_model_dir):
    """Rows with different prompts: no prefix to share, but the LM head still runs on masked positions only."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(10, 4000, (n,), generator=g).tolist() for n in (30, 45)]
    b = make_batch([traj(rows[0], [0] * 10 + [1] * 5 + [0] * 10 + [1] * 5), traj(rows[1], [0] * 40 + [1] * 5)],
                   [1.0, 1.0])
    full_BT, full_ent_BT = token_logprobs(model, b.ids_BT, b.attention_BT, True)
    masked_BT, masked_ent_BT = token_logprobs(model, b.ids_BT, b.attention_BT, True, b.mask_BT)
    torch.testing.assert_close(masked_BT, full_BT * b.mask_BT, atol=1e-5, rtol=0)
    torch.testing.assert_close(masked_ent_BT, full_ent_BT * b.mask_BT, atol=1e-5, rtol=0)


def test_gradient_checkpointing_gives_the_same_logprobs_and_gradients(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(10, 4000, (40,), generator=g).tolist()
    rows = [prefix + torch.randint(10, 4000, (10,), generator=g).tolist() for _ in range(3)]
    b = make_batch([traj(r, [0] * 42 + [1] * 8) for r in rows], [1.0, -1.0, 0.5])
    results = []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        model.zero_grad()
        logp_BT, _ = token_logprobs(model, b.ids_BT, b.attention_BT, False, b.mask_BT)
        (logp_BT * b.adv_BT).sum().backward()
        results.append((logp_BT.detach(), [p.grad.clone() for p in model.parameters()]))
    (lp0, g0), (lp1, g1) = results
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=0)
    for a, c in zip(g0, g1):
        torch.testing.assert_close(c, a, atol=1e-5, rtol=1e-4)
