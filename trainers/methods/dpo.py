"""DPO on trajectory pairs: an offline alternative to online RL.

Sample `group_size` episodes per training task from the current policy (once), pair the best and the
worst of each group by training reward (`reward`: the env's, or any mix of `agentrl.trainers.rewards`
sources) as preferred vs rejected, and train on `dpo_loss` against a frozen copy of
the starting model. Both trajectories keep their loss masks, so only sampled tokens count, exactly as in
GRPO; error episodes never enter a pair.
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch
from pydantic import with_config

from agentrl.config import STRICT
from agentrl.policy.logprobs import token_logprobs
from agentrl.policy.precision import autocast
from agentrl.rollout.engine import RolloutConfig, RolloutEngine
from agentrl.trainers.batch import make_batch
from agentrl.trainers.checkpoint import latest_checkpoint, save_checkpoint
from agentrl.trainers.loop import check_loop_rollout
from agentrl.trainers.losses import dpo_loss
from agentrl.trainers.methods.stage import RLStage
from agentrl.trainers.rewards import RewardConfig, rewarded
from agentrl.trainers.rewards.confidence import score_confidence
from agentrl.trainers.supervised import fit, shuffled
from agentrl.types import Group, Trajectory


@with_config(STRICT)
@dataclass(frozen=True)
class DPOConfig:
    tasks: int = 256  # training tasks to sample pairs from
    group_size: int = 4  # samples per task, the best and worst of which make a pair
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # its group_size is `group_size`, its seed `seed`
    reward: RewardConfig = field(default_factory=RewardConfig)  # what ranks a group's episodes
    beta: float = 0.1
    label_smoothing: float = 0.0
    min_margin: float = 1e-6  # a pair needs the preferred reward to beat the rejected one by more than this
    epochs: int = 2
    lr: float = 1e-5
    pairs_per_step: int = 8
    max_grad_norm: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        check_loop_rollout("dpo", self.rollout)
        if self.group_size < 2:
            raise ValueError("dpo.group_size must be >= 2: pairs come from samples of one task")
        if self.min_margin < 0:
            raise ValueError(f"min_margin must be >= 0, got {self.min_margin}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {self.label_smoothing}")


def preference_pairs(groups: Sequence[Group], reward: RewardConfig = RewardConfig(), min_margin: float = 1e-6,
                     model: torch.nn.Module | None = None) -> list[tuple[Trajectory, Trajectory]]:
    """(preferred, rejected) per group: its highest- and lowest-reward valid trajectories (the first of
    equals), when their rewards differ by more than `min_margin`. `model` scores the policy's confidence, for the
    sources that need it."""
    if reward.confident:
        if model is None:
            raise ValueError(f"the reward {reward.describe()} needs the policy's model to score its confidence")
        score_confidence(model, groups)
    pairs = []
    for g in groups:
        trajectories, rewards = rewarded(g, reward)
        if len(trajectories) < 2:
            continue
        best = max(range(len(rewards)), key=rewards.__getitem__)
        worst = min(range(len(rewards)), key=rewards.__getitem__)
        if rewards[best] - rewards[worst] > min_margin:
            pairs.append((trajectories[best], trajectories[worst]))
    return pairs


def train_dpo(model: torch.nn.Module, pairs: Sequence[tuple[Trajectory, Trajectory]], cfg: DPOConfig,
              on_step: Callable[[dict], None] | None = None) -> list[dict]:
    """Trains `model` in place; the reference is a frozen copy of it as it is now."""
    if not pairs:
        raise ValueError("No preference pairs: every group's episodes got the same reward. Sample more tasks "
                         "or a larger group_size, or start from a model whose episodes differ in reward.")
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    rows = [t for pair in pairs for t in pair]  # chosen, rejected, chosen, rejected, ...
    batch = make_batch(rows)
    device = next(model.parameters()).device
    steps = ([(epoch, batch.select(torch.stack([2 * ids, 2 * ids + 1], 1).flatten()).to(device))]  # pairs adjacent
             for epoch, ids in shuffled(len(pairs), cfg.pairs_per_step, cfg.epochs, cfg.seed))

    def loss_of(epoch_and_batch):
        epoch, mb = epoch_and_batch
        with autocast(model):  # the compute dtype, over float32 master weights (if marked); ref: a copy
            logp_BT, _ = token_logprobs(model, mb.ids_BT, mb.attention_BT, mask_BT=mb.mask_BT)
            with torch.no_grad():
                ref_logp_BT, _ = token_logprobs(ref, mb.ids_BT, mb.attention_BT, mask_BT=mb.mask_BT)
        loss, metrics = dpo_loss(logp_BT, ref_logp_BT, mb.mask_BT, beta=cfg.beta, label_smoothing=cfg.label_smoothing)
        return loss, {"epoch": epoch, **metrics}

    return fit(model, steps, loss_of, lr=cfg.lr, name="DPO", max_grad_norm=cfg.max_grad_norm, on_step=on_step)


class DPOStage(RLStage):
    """`[dpo]`, instead of GRPO: sample groups from the starting model once, pair the best and worst of each,
    train DPO, save (as checkpoint 1, weight version 1)."""

    def trains(self) -> bool:
        return True  # offline: no loop of steps that could be 0

    def train(self) -> dict[str, Any]:
        s, cfg = self.setup, self.setup.job.dpo
        if (checkpoint := latest_checkpoint(s.out)) is not None:  # DPO finished in an earlier run
            s.load(checkpoint, version=1)
            return {}
        with RolloutEngine(s.make_env, s.policy, s.renderer, replace(cfg.rollout, group_size=cfg.group_size, seed=cfg.seed)) as engine:
            groups = asyncio.run(engine.run(s.tasks[:cfg.tasks]))
        pairs = preference_pairs(groups, cfg.reward, cfg.min_margin, s.model)
        s.log(f"DPO: {len(pairs)} preference pairs from {len(groups)} tasks × {cfg.group_size} samples")
        history = train_dpo(s.model, pairs, cfg)
        asyncio.run(s.policy.sync_weights(s.model, 1))
        optimizer = torch.optim.AdamW(s.model.parameters())  # a fresh one: DPO is offline, there is nothing to resume
        save_checkpoint(s.out, 1, s.model, s.tokenizer, state={"weight_version": 1}, optimizer=optimizer)
        last = history[-1]
        s.log(f"DPO: {len(history)} steps, final loss {last['loss']:.3f}, "
              f"reward accuracy {last['reward_accuracy']:.2f}")
        return {"dpo": {"pairs": len(pairs), "steps": len(history), "final_loss": last["loss"],
                        "reward_accuracy": last["reward_accuracy"]}}
