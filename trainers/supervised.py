"""The supervised loop that SFT, DPO and the copy warm-up share: for each batch, a loss → backward → (clip) → AdamW
step, one metrics row per step, stopped at the first non-finite number. What differs between them is only how
batches are drawn and what the loss is; each passes those in.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, TypeVar

import torch

from agentrl.trainers.metrics import check_finite

B = TypeVar("B")


def fit(model: torch.nn.Module, batches: Iterable[B], loss_of: Callable[[B], tuple[torch.Tensor, dict]], *,
        lr: float, name: str, max_grad_norm: float | None = None,
        on_step: Callable[[dict], None] | None = None) -> list[dict]:
    """Trains `model` in place, one AdamW step per batch; `loss_of(batch)` gives (loss, the row's other metrics).
    Returns the rows (`loss`, `grad_norm` when clipping, and the loss's metrics); `name` names the step that
    gives a non-finite number."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    history: list[dict] = []
    model.train()
    for batch in batches:
        loss, metrics = loss_of(batch)
        optimizer.zero_grad()
        loss.backward()
        row = {**metrics, "loss": loss.item()}
        if max_grad_norm is not None:
            row["grad_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm).item()
        check_finite(f"{name} step {len(history) + 1}", row)  # before the step: the weights stay finite
        optimizer.step()
        history.append(row)
        if on_step:
            on_step(row)
    model.eval()
    return history


def shuffled(n: int, size: int, epochs: int, seed: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(epoch, indices) of `epochs` passes over `n` items, each pass in a fresh seeded order, `size` at a time."""
    generator = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, size):
            yield epoch, order[start:start + size]
