"""The LM head in chunks under checkpointing: the same logprobs, entropies and gradients as the head over all
sampled tokens at once, and nothing of the vocabulary's size kept for the backward."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl.policy.logprobs import head_logprobs, token_logprobs
from agentrl.trainers.batch import make_batch
from agentrl.types import Trajectory, Turn


def traj(ids, mask):
    n = len(ids)
    return Trajectory("t", tuple(ids), tuple(mask), (0.0,) * n, 2, (Turn(2, n, n),), 1.0)


def episodes(shared_prefix: int):
    """Three rows, 37 sampled tokens in all, in two turns of each row; a common prompt of `shared_prefix`."""
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(10, 4000, (shared_prefix,), generator=g).tolist()
    rows, masks = [], []
    for own, first, second in ((6, 5, 9), (10, 8, 4), (3, 6, 5)):
        body = torch.randint(10, 4000, (own + first + 4 + second,), generator=g).tolist()
        rows.append(prefix + body)
        masks.append([0] * (shared_prefix + own) + [1] * first + [0] * 4 + [1] * second)
    return make_batch([traj(r, m) for r, m in zip(rows, masks)], [1.0, -1.0, 0.5])


def logprobs_and_grads(model, b, chunk):
    model.zero_grad()
    logp_BT, entropy_BT = token_logprobs(model, b.ids_BT, b.attention_BT, True, b.mask_BT, head_chunk=chunk)
    (logp_BT * b.adv_BT).sum().backward()
    return logp_BT.detach(), entropy_BT, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("shared_prefix", [0, 40])  # without and with the prefix pass
# float64 weights: the same gradients up to 1e-6 (in fact ~1e-15). float32: the sums over chunks run in another
# order, and the gradients move by float32 rounding, up to ~2e-6 of each tensor's largest entry.
@pytest.mark.parametrize("dtype, grad_tol", [(torch.float64, 0.0), (torch.float32, 1e-5)])
def test_chunked_head_gives_the_same_logprobs_entropy_and_gradients(tiny_model_dir, shared_prefix, dtype, grad_tol):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype)
    b = episodes(shared_prefix)
    assert b.mask_BT.sum() == 37
    lp0, e0, g0 = logprobs_and_grads(model, b, None)  # all 37 at once, no checkpointing
    for chunk in (1, 5, 16, 37, 1024):  # 5 and 16 don't divide 37; 1024 is one chunk
        lp, e, g = logprobs_and_grads(model, b, chunk)
        torch.testing.assert_close(lp, lp0, atol=1e-6, rtol=0)
        torch.testing.assert_close(e, e0, atol=0, rtol=1e-6)  # sums over the vocabulary, of size ~8
        assert not e.requires_grad  # a metric, computed without autograd
        for name in g0:
            assert (g[name] - g0[name]).abs().max() <= max(1e-6, grad_tol * g0[name].abs().max()), name
    assert ((lp0 != 0) == (b.mask_BT > 0)).all()  # a logprob on every sampled token, 0 elsewhere
    full_BT, full_e_BT = token_logprobs(model, b.ids_BT, b.attention_BT, True)  # the [B, T, vocab] path
    torch.testing.assert_close(lp0, full_BT * b.mask_BT, atol=1e-5, rtol=0)
    torch.testing.assert_close(e0, full_e_BT * b.mask_BT, atol=1e-5, rtol=0)


def test_head_gradients_wrt_hidden_states_and_weights_with_soft_capping(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)  # float32: see above
    model.config.final_logit_softcapping = 3.0  # Gemma-2 has 30; here small enough to change the logprobs
    g = torch.Generator().manual_seed(1)
    hidden_NH = 30 * torch.randn(50, model.config.hidden_size, generator=g, dtype=torch.float64)  # logits of size ~10
    targets_N = torch.randint(0, model.config.vocab_size, (50,), generator=g)
    weights_N = torch.randn(50, generator=g)
    results = []
    for chunk in (None, 7, 50):
        h = hidden_NH.clone().requires_grad_(True)
        model.zero_grad()
        logp_N, entropy_N = head_logprobs(model, h, targets_N, True, chunk)
        (logp_N * weights_N).sum().backward()
        results.append((logp_N.detach(), entropy_N, h.grad, model.get_output_embeddings().weight.grad.clone()))
    (lp0, e0, dh0, dw0), chunked = results[0], results[1:]
    for lp, e, dh, dw in chunked:
        torch.testing.assert_close(lp, lp0, atol=1e-6, rtol=0)
        torch.testing.assert_close(e, e0, atol=0, rtol=1e-6)
        torch.testing.assert_close(dh, dh0, atol=1e-6, rtol=0)
        torch.testing.assert_close(dw, dw0, atol=1e-6, rtol=0)
    model.config.final_logit_softcapping = None
    uncapped_N, _ = head_logprobs(model, hidden_NH, targets_N)
    assert (uncapped_N - results[0][0]).abs().max() > 1e-2  # the cap is applied


def test_nothing_of_vocabulary_size_is_kept_for_the_backward(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    b = episodes(0)
    V = model.config.vocab_size
    for chunk, keeps_vocab in ((None, True), (8, False)):
        sizes = []
        # Checkpointed chunks save only through their own hooks (innermost wins), so this sees what outlives them.
        with torch.autograd.graph.saved_tensors_hooks(lambda t, seen=sizes: seen.append(t.shape) or t, lambda t: t):
            token_logprobs(model, b.ids_BT, b.attention_BT, True, b.mask_BT, head_chunk=chunk)
        assert any(V in s for s in sizes) == keeps_vocab, sizes


def test_no_sampled_tokens_and_no_grad(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    b = episodes(0)
    logp_BT, entropy_BT = token_logprobs(model, b.ids_BT, b.attention_BT, True, torch.zeros_like(b.mask_BT))
    assert logp_BT.abs().max() == 0 and entropy_BT.abs().max() == 0
    with torch.no_grad():
        lp, e = token_logprobs(model, b.ids_BT, b.attention_BT, True, b.mask_BT, head_chunk=4)
    lp0, e0 = token_logprobs(model, b.ids_BT, b.attention_BT, True, b.mask_BT, head_chunk=None)
    torch.testing.assert_close(lp, lp0.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(e, e0, atol=0, rtol=1e-6)


def test_full_position_path_chunks_its_log_softmax(tiny_model_dir):
    """Without a mask (and under FSDP) the head runs in the model's forward; its log-softmax goes by rows."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    b = episodes(0)
    results = []
    for chunk in (None, 10, 60, 1024):  # rows of 25 predicted positions: 1, 2 and all 3 rows per chunk
        model.zero_grad()
        logp_BT, entropy_BT = token_logprobs(model, b.ids_BT, b.attention_BT, True, head_chunk=chunk)
        assert logp_BT.shape == entropy_BT.shape == b.ids_BT.shape
        (logp_BT * b.adv_BT).sum().backward()
        results.append((logp_BT.detach(), entropy_BT, [p.grad.clone() for p in model.parameters()]))
    (lp0, e0, g0), chunked = results[0], results[1:]
    for lp, e, g in chunked:
        torch.testing.assert_close(lp, lp0, atol=1e-6, rtol=0)
        torch.testing.assert_close(e, e0, atol=0, rtol=1e-6)
        for a, c in zip(g0, g):
            torch.testing.assert_close(c, a, atol=1e-6, rtol=0)


def test_packed_rows_go_through_the_chunked_head_too(tiny_model_dir):
    """Packing (tests/test_packing.py) changes only the decoder's layout: the head still runs in chunks."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    b = episodes(0)
    V, sizes = model.config.vocab_size, []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.shape) or t, lambda t: t):
        token_logprobs(model, b.ids_BT, b.attention_BT, True, b.mask_BT, head_chunk=8, pack=True)
    assert sizes and not any(V in s for s in sizes), sizes
