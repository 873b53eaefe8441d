"""Copy warm-up: the alphabet comes from the env's text, the repeat gets learned, and the in-context phase
builds its sequences from the env's text, random spans and exact repeats."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl.models.tokenizer import load_tokenizer
from agentrl.trainers.pretrain import CopyWarmup, alphabet, context_sequence, copy_in_context, copy_warmup, vocabulary


def test_alphabet_is_the_tokens_of_the_texts(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = alphabet(["Compute 3 + 4.", "Final Answer: 7"], tokenizer)
    assert ids == sorted(set(tokenizer.encode("Compute 3 + 4.") + tokenizer.encode("Final Answer: 7")))
    with pytest.raises(ValueError, match="min_len"):
        CopyWarmup(min_len=5, max_len=4)
    for rate in (0.0, 1.0):
        with pytest.raises(ValueError, match="copy_rate"):
            CopyWarmup(copy_rate=rate)
    with pytest.raises(ValueError, match="context_len"):
        CopyWarmup(context_steps=10, context_len=40, max_len=24)
    with pytest.raises(ValueError, match="context_vocab_steps"):
        CopyWarmup(context_vocab_steps=10)


def test_vocabulary_is_every_token_but_the_special_ones(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    special = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    ids = vocabulary(tokenizer)
    assert len(ids) == len(tokenizer) - 3 and not set(special) & set(ids)
    assert set(alphabet(["Who founded Quorbex Systems?"], tokenizer)) <= set(ids)


def test_context_sequence_mixes_text_random_spans_and_exact_repeats():
    texts = [list(range(1000, 1100)), list(range(2000, 2050))]
    tokens = list(range(10, 40))
    cfg = CopyWarmup(min_len=3, max_len=6, context_len=200, copy_rate=0.5)
    generator = torch.Generator().manual_seed(0)
    kinds = set()
    for _ in range(20):
        ids, predictable = context_sequence(generator, tokens, texts, cfg)
        assert len(ids) == len(predictable) == 200
        for i, p in enumerate(predictable):
            if p:  # a copied token follows its source: the token after an earlier occurrence of its predecessor
                assert any(ids[j] == ids[i - 1] and ids[j + 1] == ids[i] for j in range(i - 1)), i
        kinds |= {"text" if t >= 1000 else "random" for t in ids}
        kinds |= {"copy"} if any(predictable) else set()
        assert not predictable[0]
    assert kinds == {"text", "random", "copy"}
    assert 0.2 < sum(sum(context_sequence(generator, tokens, texts, cfg)[1]) for _ in range(10)) / 2000 < 0.6
    # without texts the spans are the alphabet's
    ids, _ = context_sequence(generator, tokens, [], cfg)
    assert set(ids) <= set(tokens)


@pytest.mark.slow
def test_copy_warmup_learns_to_repeat(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokens = alphabet(["0 1 2 3"], load_tokenizer(tiny_model_dir))  # a handful of tokens: fast to learn
    history = copy_warmup(model, tokens, CopyWarmup(steps=150, batch_size=16, min_len=3, max_len=6, lr=3e-3))
    first, last = history[:10], history[-10:]
    accuracy = lambda rows: sum(r["copy_accuracy"] for r in rows) / len(rows)  # noqa: E731
    # chance is 1/5; measured: 0.24 over the first 10 steps, 0.50 over the last 10 (full copying takes
    # thousands of steps, too long for a test)
    assert accuracy(last) > accuracy(first) + 0.2, (accuracy(first), accuracy(last))
    assert not model.training


@pytest.mark.slow
def test_copy_in_context_learns_to_continue_repeats(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokens = alphabet(["0 1 2 3"], load_tokenizer(tiny_model_dir))
    texts = [[tokens[i % 3] for i in range(40)]]  # a periodic "text": its spans are predictable too
    cfg = CopyWarmup(min_len=3, max_len=6, context_steps=150, context_len=48, context_batch_size=8, lr=3e-3)
    history = copy_in_context(model, tokens, texts, cfg)
    first, last = history[:10], history[-10:]
    accuracy = lambda rows: sum(r["copy_accuracy"] for r in rows) / len(rows)  # noqa: E731
    assert accuracy(last) > accuracy(first) + 0.2, (accuracy(first), accuracy(last))
    assert not model.training
