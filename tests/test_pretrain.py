"""Copy warm-up: the alphabet comes from the env's text, and the repeat gets learned."""

import pytest
from transformers import AutoModelForCausalLM

from agentrl.tiny_model import load_tokenizer
from agentrl.trainers.pretrain import CopyWarmup, alphabet, copy_warmup


def test_alphabet_is_the_tokens_of_the_texts(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = alphabet(["Compute 3 + 4.", "Final Answer: 7"], tokenizer)
    assert ids == sorted(set(tokenizer.encode("Compute 3 + 4.") + tokenizer.encode("Final Answer: 7")))
    with pytest.raises(ValueError, match="min_len"):
        CopyWarmup(min_len=5, max_len=4)


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
