"""Copy warm-up: teach a randomly initialized model to copy before it imitates or explores.

The tiny CPU model starts from random weights, and agent tasks are full of copying: the numbers of a
problem into a calculator call, an entity name into a search query, a tool's result into the answer.
Without induction heads it cannot do that, SFT teaches it the format but not the values, and RL then has
no successes to reinforce. A few thousand steps on sequences `x x` (random tokens, repeated; the loss on
the repeat only) make copying emerge. The tokens are drawn from the env's own text (`alphabet`; the
pipeline uses the tokens of the expert's answers), so the embeddings that matter are the ones trained: a
small alphabet also learns fast (measured: 30 tokens reach 0.9 copy accuracy in about 2,000 steps, the
full 4,096-token vocabulary shows no progress in 1,500). Pretrained LLMs copy already and need none of this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from pydantic import with_config

from agentrl.config import STRICT
from agentrl.trainers.batch import lm_head


@with_config(STRICT)
@dataclass(frozen=True)
class CopyWarmup:
    steps: int = 3000
    batch_size: int = 32
    min_len: int = 4  # length of the random sequence that is then repeated
    max_len: int = 24
    # Random tokens before the sequence (up to max_prefix) and between it and its repeat (up to max_gap). Without
    # them the copy learned is positional: measured on the search env's warm-up, copy accuracy 0.90 at position 0
    # and 0.00 after a 50-token prefix, where the env copies a name ~200 tokens into its prompt. With a prefix of
    # up to 192 tokens the tiny model did not start copying in 1,200 steps (recipes/cpu_search_r1_train.toml).
    max_prefix: int = 0
    max_gap: int = 0
    lr: float = 1e-3
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")
        if min(self.max_prefix, self.max_gap) < 0:
            raise ValueError(f"max_prefix and max_gap must be >= 0, got {self.max_prefix}, {self.max_gap}")


def alphabet(texts: Iterable[str], tokenizer: Any) -> list[int]:
    """The token ids that occur in these texts (e.g. an env's prompts and expert answers)."""
    return sorted({i for text in texts for i in tokenizer.encode(text, add_special_tokens=False)})


def copy_warmup(model: torch.nn.Module, tokens: list[int], cfg: CopyWarmup,
                on_step: Callable[[dict], None] | None = None) -> list[dict]:
    """Trains `model` in place to continue `p x g` with `x` again (`p`, `g`: random prefix and gap, possibly
    empty); returns per-step loss, copy accuracy and the prefix and gap lengths."""
    if len(tokens) < 2:
        raise ValueError("copy warm-up needs an alphabet of at least 2 tokens")
    generator = torch.Generator().manual_seed(cfg.seed)
    alphabet_A = torch.tensor(tokens)
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    history = []
    model.train()
    for step in range(cfg.steps):
        # Drawn only when enabled, so that max_prefix = max_gap = 0 replays the earlier warm-up exactly.
        n = int(torch.randint(cfg.min_len, cfg.max_len + 1, (), generator=generator))
        prefix, gap = (int(torch.randint(hi + 1, (), generator=generator)) if hi else 0
                       for hi in (cfg.max_prefix, cfg.max_gap))
        seq_BN, prefix_BP, gap_BG = (alphabet_A[torch.randint(len(tokens), (cfg.batch_size, k), generator=generator)]
                                     if k else alphabet_A[:0].expand(cfg.batch_size, 0) for k in (n, prefix, gap))
        ids_BT = torch.cat([prefix_BP, seq_BN, gap_BG, seq_BN], dim=1).to(device)
        hidden_BNH = model.base_model(input_ids=ids_BT).last_hidden_state[:, -n - 1:-1]  # predicts the repeat
        logits_BNV = lm_head(model, hidden_BNH).float()  # the LM head on those positions only
        loss = F.cross_entropy(logits_BNV.flatten(0, 1), ids_BT[:, -n:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        row = {"step": step, "loss": loss.item(), "prefix": prefix, "gap": gap,
               "copy_accuracy": (logits_BNV.argmax(-1) == ids_BT[:, -n:]).float().mean().item()}
        history.append(row)
        if on_step:
            on_step(row)
    model.eval()
    return history
