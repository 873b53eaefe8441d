"""Copy warm-up: the alphabet comes from the env's text, and the repeat gets learned."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl.tiny_model import load_tokenizer
from agentrl.trainers.pretrain import CopyWarmup, alphabet, copy_warmup


def test_alphabet_is_the_tokens_of_the_texts(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = alphabet(["Compute 3 + 4.", "Final Answer: 7"], tokenizer)
    assert ids == sorted(set(tokenizer.encode("Compute 3 + 4.") + tokenizer.encode("Final Answer: 7")))
    with pytest.raises(ValueError, match="min_len"):
        CopyWarmup(min_len=5, max_len=4)
    with pytest.raises(ValueError, match="max_prefix and max_gap"):
        CopyWarmup(max_prefix=-1)


class Recorder(torch.nn.Module):
    """Stands in for a model: records the sequences the warm-up builds and predicts nothing useful."""

    def __init__(self, vocab: int = 50):
        super().__init__()
        self.lm_head = torch.nn.Linear(4, vocab)
        self.embed = torch.nn.Embedding(vocab, 4)
        self.seen, self.config = [], SimpleNamespace()

    def get_output_embeddings(self):
        return self.lm_head

    def base_model(self, input_ids):
        self.seen.append(input_ids)
        return SimpleNamespace(last_hidden_state=self.embed(input_ids))


def test_copy_warmup_puts_the_sequence_after_a_random_prefix_and_repeats_it_after_a_gap():
    model = Recorder()
    history = copy_warmup(model, list(range(10, 40)), CopyWarmup(steps=40, batch_size=2, min_len=3, max_len=5,
                                                                 max_prefix=20, max_gap=6))
    for row, ids_BT in zip(history, model.seen):
        n = (ids_BT.shape[1] - row["prefix"] - row["gap"]) // 2
        assert 3 <= n <= 5 and 0 <= row["prefix"] <= 20 and 0 <= row["gap"] <= 6
        p = row["prefix"]
        assert torch.equal(ids_BT[:, p:p + n], ids_BT[:, -n:])  # the repeat ends the sequence
    assert len({r["prefix"] for r in history}) > 5 and len({r["gap"] for r in history}) > 3
    assert all(r["prefix"] == r["gap"] == 0 for r in copy_warmup(Recorder(), list(range(10, 40)),
                                                                  CopyWarmup(steps=5, batch_size=2)))


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
