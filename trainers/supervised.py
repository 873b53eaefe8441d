"""The supervised loop that SFT, DPO and the copy warm-up share: for each step, a loss → backward per micro-batch
(gradient accumulation) → (clip) → AdamW step, one metrics row per step, stopped at the first non-finite number.
What differs between them is only how batches are drawn and what the loss is; each passes those in.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Sequence, TypeVar

import torch

from agentrl.trainers.metrics import check_finite

B = TypeVar("B")


def fit(model: torch.nn.Module, steps: Iterable[Sequence[B]], loss_of: Callable[[B], tuple[torch.Tensor, dict]], *,
        lr: float, name: str, max_grad_norm: float | None = None,
        on_step: Callable[[dict], None] | None = None) -> list[dict]:
    """Trains `model` in place, one AdamW step per item of `steps`: its micro-batches' gradients accumulate, and
    `loss_of(micro_batch)` gives (its share of the step's loss, the row's other metrics). Returns the rows (`loss`,
    `grad_norm` when clipping, and the loss's metrics); `name` names the step that gives a non-finite number."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    history: list[dict] = []
    model.train()
    for micro_batches in steps:
        optimizer.zero_grad()
        row = {"loss": 0.0}
        for micro_batch in micro_batches:
            loss, metrics = loss_of(micro_batch)
            loss.backward()  # before the next forward pass: one micro-batch's activations in memory at a time
            row = {**metrics, "loss": row["loss"] + loss.item()}
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
