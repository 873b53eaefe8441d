"""Copy warm-up: teach a randomly initialized model to copy before it imitates or explores.

The tiny CPU model starts from random weights, and agent tasks are full of copying: the numbers of a
problem into a calculator call, an entity name into a search query, a tool's result into the answer.
Without induction heads it cannot do that, SFT teaches it the format but not the values, and RL then has
no successes to reinforce. A few thousand steps on sequences `x x` (random tokens, repeated; the loss on
the repeat only) make copying emerge. The tokens are drawn from the env's own text (`alphabet`; the
pipeline uses the tokens of the expert's answers), so the embeddings that matter are the ones trained: a
small alphabet also learns fast (measured: 30 tokens reach 0.9 copy accuracy in about 2,000 steps, the
full 4,096-token vocabulary shows no progress in 1,500). That copy works only where it was learned (at the
start of a short sequence of alphabet tokens); the optional second phase (`copy_in_context`) moves it to
where agents copy: anywhere in long sequences that mix the env's own text with repeated spans, and its
optional continuation (`context_vocab_steps`) to every token of the vocabulary.
Pretrained LLMs copy already and need none of this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from pydantic import with_config

from agentrl.config import STRICT
from agentrl.policy.logprobs import lm_head
from agentrl.policy.precision import autocast
from agentrl.trainers.supervised import fit


@with_config(STRICT)
@dataclass(frozen=True)
class CopyWarmup:
    steps: int = 3000
    batch_size: int = 32
    min_len: int = 4  # length of the random sequence that is then repeated
    max_len: int = 24
    lr: float = 1e-3
    seed: int = 0
    # Second phase (0 steps: none), copying in context: `context_len`-token sequences of spans (min_len..max_len
    # tokens) that are slices of the env's own text or random alphabet tokens, a `copy_rate` of them repeating an
    # earlier span; the loss covers every token. The first phase's copy only works where it was learned: at the
    # start of a short sequence of alphabet tokens. Measured on the search env's: 0.90 there, 0.00 after 50 tokens
    # of its prompt; after 400 steps of this phase on alphabet tokens only 0.01-0.04 there, with slices of its text
    # 0.55, but 0.00 past position 128 when the sequences had 128 tokens.
    context_steps: int = 0
    context_len: int = 512
    context_batch_size: int = 4
    copy_rate: float = 0.5
    context_episodes: int = 1024  # the env's text: this many expert episodes on training tasks (the pipeline's)
    # Then this many more steps of it whose random spans are drawn from the whole vocabulary (`vocabulary`). The
    # embeddings are untied, so a token copies only once training has used it, and names that appear only in
    # held-out questions are made of tokens no expert episode writes. Measured on the search env: name tokens
    # copied 0.30 (held-out) vs 0.71 (train) after the first two phases, 0.66 vs 0.95 after 1,000 of these steps.
    # Drawn from the whole vocabulary from the start, the in-context phase reached 0.35 in 1,500 steps, not 0.83.
    context_vocab_steps: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")
        if not 0 < self.copy_rate < 1:
            raise ValueError(f"copy_rate must be in (0, 1), got {self.copy_rate}")
        if self.context_vocab_steps and not self.context_steps:
            raise ValueError("context_vocab_steps continue the in-context phase: set context_steps too")
        if self.context_steps and self.context_len < 2 * self.max_len:
            raise ValueError(f"context_len ({self.context_len}) must hold a span and its copy: >= 2 * max_len")


def alphabet(texts: Iterable[str], tokenizer: Any) -> list[int]:
    """The token ids that occur in these texts (e.g. an env's prompts and expert answers)."""
    return sorted({i for text in texts for i in tokenizer.encode(text, add_special_tokens=False)})


def vocabulary(tokenizer: Any) -> list[int]:
    """Every token id of the tokenizer but its added (special) tokens."""
    added = set(tokenizer.added_tokens_decoder)
    return [i for i in range(len(tokenizer)) if i not in added]


def copy_warmup(model: torch.nn.Module, tokens: list[int], cfg: CopyWarmup,
                on_step: Callable[[dict], None] | None = None) -> list[dict]:
    """Trains `model` in place to continue `x` with `x` again; returns per-step loss and copy accuracy."""
    if len(tokens) < 2:
        raise ValueError("copy warm-up needs an alphabet of at least 2 tokens")
    generator = torch.Generator().manual_seed(cfg.seed)
    alphabet_A = torch.tensor(tokens)
    device = next(model.parameters()).device

    def batches():
        for step in range(cfg.steps):
            n = int(torch.randint(cfg.min_len, cfg.max_len + 1, (), generator=generator))
            seq_BN = alphabet_A[torch.randint(len(tokens), (cfg.batch_size, n), generator=generator)]
            yield [(step, n, torch.cat([seq_BN, seq_BN], dim=1).to(device))]

    def loss_of(batch):
        step, n, ids_BT = batch
        with autocast(model):  # the compute dtype, over float32 master weights (if marked)
            hidden_BNH = model.base_model(input_ids=ids_BT).last_hidden_state[:, -n - 1:-1]  # predicts the repeat
            logits_BNV = lm_head(model, hidden_BNH).float()  # the LM head on those positions only
        loss = F.cross_entropy(logits_BNV.flatten(0, 1), ids_BT[:, -n:].flatten())
        return loss, {"step": step, "copy_accuracy": (logits_BNV.argmax(-1) == ids_BT[:, -n:]).float().mean().item()}

    return fit(model, batches(), loss_of, lr=cfg.lr, name="copy warm-up", on_step=on_step)


def context_sequence(generator: torch.Generator, tokens: list[int], texts: Sequence[Sequence[int]],
                     cfg: CopyWarmup) -> tuple[list[int], list[bool]]:
    """One `context_len`-token sequence for copying in context, and which of its tokens a copy makes
    predictable (every token of a copied span but its first)."""
    ids: list[int] = []
    predictable: list[bool] = []
    draw = lambda hi: int(torch.randint(hi, (), generator=generator))  # noqa: E731
    while len(ids) < cfg.context_len:
        n = cfg.min_len + draw(cfg.max_len - cfg.min_len + 1)
        if len(ids) >= cfg.max_len and float(torch.rand((), generator=generator)) < cfg.copy_rate:
            start = draw(len(ids) - n + 1)
            span, copied = ids[start:start + n], True
        elif texts and draw(2):
            text = texts[draw(len(texts))]
            start = draw(max(1, len(text) - n + 1))
            span, copied = list(text[start:start + n]), False
        else:
            span, copied = [tokens[draw(len(tokens))] for _ in range(n)], False
        ids += span
        predictable += [False] + [copied] * (len(span) - 1)
    return ids[:cfg.context_len], predictable[:cfg.context_len]


def copy_in_context(model: torch.nn.Module, tokens: list[int], texts: Sequence[Sequence[int]], cfg: CopyWarmup,
                    on_step: Callable[[dict], None] | None = None) -> list[dict]:
    """The second phase: trains `model` in place on `context_sequence`s built from the alphabet `tokens` and
    the env's text `texts` (token ids); returns per-step loss and the accuracy on the predictable copies."""
    generator = torch.Generator().manual_seed(cfg.seed)
    device = next(model.parameters()).device

    def batches():
        for step in range(cfg.context_steps):
            rows = [context_sequence(generator, tokens, texts, cfg) for _ in range(cfg.context_batch_size)]
            yield [(step, torch.tensor([ids for ids, _ in rows], device=device),
                    torch.tensor([copied for _, copied in rows], device=device)[:, 1:])]

    def loss_of(batch):
        step, ids_BT, copied_BT = batch
        with autocast(model):
            logits_BTV = model(input_ids=ids_BT).logits[:, :-1].float()
        loss = F.cross_entropy(logits_BTV.flatten(0, 1), ids_BT[:, 1:].flatten())
        hits_BT = logits_BTV.argmax(-1) == ids_BT[:, 1:]
        return loss, {"step": step, "copy_accuracy": hits_BT[copied_BT].float().mean().item()}

    return fit(model, batches(), loss_of, lr=cfg.lr, name="copy-in-context", on_step=on_step)
