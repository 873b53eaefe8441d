"""Tutorial: add a policy-loss variant, check it against hand-worked numbers, and train with it.

    python examples/tutorials/new_loss.py [--model DIR] [--steps N] [--out DIR]

The variant is CISPO (MiniMax-M1, 2025): instead of clipping the PPO surrogate, which zeroes the gradient
of clipped tokens, it clips the importance weight itself and keeps it out of the gradient, so every token
still teaches: l_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A_t * logp_t.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from torch import Tensor

from agentrl.trainers.losses import POLICY_LOSSES, PolicyLossConfig, aggregate, masked_mean


# --8<-- [start:loss]
def cispo_loss(logp_BT: Tensor, old_logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor,
               cfg: PolicyLossConfig) -> tuple[Tensor, dict[str, float]]:
    """CISPO: the clipped importance weight, detached, times A_t log p_t; aggregated with `cfg.agg`."""
    # The losses' contract: mask-0 positions (what the env wrote, padding) are replaced by zeros first, so
    # whatever sits there, even nan, changes neither the loss nor the gradient.
    sampled = mask_BT.bool()
    m = sampled.float()
    logp = torch.where(sampled, logp_BT, 0.0)
    old, adv = (torch.where(sampled, x.detach(), 0.0) for x in (old_logp_BT, adv_BT))
    ratio = (logp - old).exp()
    weight = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high).detach()
    loss_BT = -weight * adv * logp
    clipped = (weight != ratio.detach()) & m.bool()
    return aggregate(loss_BT, m, cfg.agg, norm_const=cfg.norm_const), {
        "clip_frac": masked_mean(clipped.float(), m).item(), "ratio_mean": masked_mean(ratio.detach(), m).item()}


POLICY_LOSSES["cispo"] = cispo_loss  # now `loss = "cispo"` is valid in [grpo] (and in [ppo])
# --8<-- [end:loss]


# --8<-- [start:check]
def check_by_hand() -> None:
    """One sequence, three positions, the last not sampled (mask 0: whatever sits there must not count)."""
    logp = torch.tensor([[math.log(0.5), math.log(0.25), 123.0]], requires_grad=True)
    old = torch.tensor([[math.log(0.25), math.log(0.25), float("nan")]])
    adv = torch.tensor([[1.0, -1.0, 5.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = cispo_loss(logp, old, adv, mask, PolicyLossConfig(clip_low=0.2, clip_high=0.28))
    # r = (2, 1): the first weight clips to 1.28. Token-mean over 2 tokens:
    # -(1.28 * 1 * log 0.5 + 1 * (-1) * log 0.25) / 2 = -(-0.887228 + 1.386294) / 2 = -0.249533
    assert abs(loss.item() - (-0.249533)) < 1e-5, loss.item()
    loss.backward()
    # d loss / d logp_t = -weight_t * A_t / 2 = (-0.64, 0.5), and exactly 0 where the mask is 0.
    assert torch.allclose(logp.grad, torch.tensor([[-0.64, 0.5, 0.0]])), logp.grad
    assert metrics["clip_frac"] == 0.5
    print(f"hand-worked example: loss {loss.item():.6f}, grad {logp.grad.tolist()}, clip_frac 0.5")
# --8<-- [end:check]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=Path.home() / ".cache/agentrl/models/tiny")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("runs/tutorial-cispo"))
    args = parser.parse_args()
    check_by_hand()

    # --8<-- [start:train]
    # Train with it: the same job a recipe describes, built in Python. GRPO on the math env from the tiny
    # model (no warm start, so do not expect it to learn in a few steps: the point is the plumbing).
    from agentrl.config import load_config
    from agentrl.models.tiny import build_tiny_model
    from agentrl.trainers.job.pipeline import run
    from agentrl.trainers.job.recipe import TrainJob

    model = build_tiny_model(args.model, quiet=True)
    job = load_config(TrainJob, {
        "env": "math/arith-v0", "model": str(model), "out_dir": str(args.out),
        "env_kwargs": {"max_turns": 2},
        "eval": {"split": "heldout", "n": 4, "rollout": {"sampling": {"max_tokens": 32, "temperature": 0.0}}},
        "grpo": {"steps": args.steps, "tasks_per_step": 2, "group_size": 4, "loss": "cispo", "lr": 1e-4,
                 "policy_loss": {"clip_low": 0.2, "clip_high": 0.28},
                 "rollout": {"sampling": {"max_tokens": 32}}},
    })
    summary = run(job)
    print({key: summary[key] for key in ("before", "after") if key in summary})
    # --8<-- [end:train]


if __name__ == "__main__":
    main()
