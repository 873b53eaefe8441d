"""PPO for multi-turn tool-using agents: the RL loop (`trainers/loop.py`) with a learned critic instead of
group baselines.

Each step: collect `tasks_per_step` groups of `group_size` episodes (one per task is usual) → token rewards:
each turn's reward on that turn's last sampled token (other reward sources on the episode's last one),
minus `kl_coef` × KL to the frozen initial policy on every sampled token when asked → the critic's values
V(ids[:t]) → GAE over the sampled tokens only (tool observations are skipped by the recursion, not
treated as zero-reward steps) → whitened advantages → `epochs` passes of the policy loss and, on the same
minibatches, of the clipped value loss → weight sync → metrics and checkpoints.

The critic is a separate model: the policy's transformer with a scalar head (`AutoModelForTokenClassification`,
num_labels 1), initialized from the policy, the head at 0, so the first advantages are the returns to go.
It is saved with each checkpoint under `critic/` and loads with `from_pretrained`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence

import torch
import torch.nn.functional as F
from pydantic import with_config
from transformers import AutoModelForTokenClassification

from agentrl.config import STRICT
from agentrl.env.api import TextEnv
from agentrl.policy.logprobs import token_logprobs
from agentrl.policy.precision import autocast, compute_dtype, mixed_precision
from agentrl.policy.protocol import Policy
from agentrl.rollout.engine import Engines, EnvEngines
from agentrl.trainers import loop
from agentrl.trainers.advantages import gae, masked_whiten, turn_rewards_to_tokens
from agentrl.trainers.batch import Batch, make_batch
from agentrl.trainers.distributed import Sharding, derived_model, frozen_copy, restore, unsharded_copy
from agentrl.trainers.losses import kl_in_reward, masked_mean, value_loss
from agentrl.trainers.methods.stage import RLStage, run_loop
from agentrl.trainers.rewards import reward_metrics, rewarded
from agentrl.trainers.rewards.confidence import CONFIDENCE_SOURCES, score_confidence
from agentrl.types import Group, Task, Trajectory


@with_config(STRICT)
@dataclass(frozen=True)
class PPOConfig(loop.LoopConfig):
    """`[ppo]`: the loop's settings (`LoopConfig`, with PPO's defaults) and the critic's."""

    section: ClassVar[str] = "ppo"
    tasks_per_step: int = 32
    kl_kind: str = "k1"  # the KL penalty is in the reward here: k1, the plain log ratio
    epochs: int = 2  # passes over each step's batch
    gamma: float = 1.0  # discount per sampled token
    lam: float = 0.95  # GAE's lambda: 1 = Monte Carlo returns minus the value, 0 = one-step TD
    whiten_advantages: bool = True  # normalize the advantages over the batch's sampled tokens
    critic_lr: float = 1e-4
    value_clip: float | None = 0.2  # PPO's value clipping around the values at collection time; None: off

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (0.0 <= self.gamma <= 1.0 and 0.0 <= self.lam <= 1.0):
            raise ValueError(f"gamma and lam must be in [0, 1], got {self.gamma}, {self.lam}")


def make_critic(model: torch.nn.Module) -> torch.nn.Module:
    """The policy's transformer with a scalar value head at 0 (no dropout: values must not be noisy), in the
    policy's precision (float32 master weights and its autocast dtype, `agentrl.policy.precision`); sharded like
    the policy when it is (`distributed.derived_model`)."""
    config = copy.deepcopy(model.config)
    config.num_labels, config.classifier_dropout = 1, 0.0
    weight, prefix = next(model.parameters()), model.base_model_prefix + "."

    def build(state: dict[str, torch.Tensor]) -> torch.nn.Module:
        critic = AutoModelForTokenClassification.from_config(config, dtype=weight.dtype)
        if state:  # none on the ranks that get their shards from rank 0
            critic.base_model.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
            head = [m for m in critic.modules() if isinstance(m, torch.nn.Linear) and m.out_features == 1][-1]
            torch.nn.init.zeros_(head.weight)
            if head.bias is not None:
                torch.nn.init.zeros_(head.bias)
            critic.to(weight.device)
        return mixed_precision(critic, compute_dtype(model))

    return derived_model(model, build)


def token_values(critic: torch.nn.Module, ids_BT: torch.Tensor, attention_BT: torch.Tensor) -> torch.Tensor:
    """values_BT[t] = V(ids[:t]), the value of the state in which token t is sampled (0 at t = 0): aligned
    with the loss mask and `token_logprobs`."""
    out_BT = critic(input_ids=ids_BT, attention_mask=attention_BT).logits[..., 0].float()
    return F.pad(out_BT[:, :-1], (1, 0))


def token_rewards(trajectories: Sequence[Trajectory], rewards_B: Sequence[float], T: int) -> torch.Tensor:
    """Each turn's env reward on the turn's last sampled token, and the rest of the training reward
    (other sources, weights) on the episode's last sampled token, so row b sums to rewards_B[b]."""
    rewards_BT = turn_rewards_to_tokens([[turn.end for turn in t.turns] for t in trajectories],
                                        [[turn.reward for turn in t.turns] for t in trajectories], T)
    for b, (t, r) in enumerate(zip(trajectories, rewards_B)):
        rewards_BT[b, t.turns[-1].end - 1] += r - sum(turn.reward for turn in t.turns)
    return rewards_BT


@torch.no_grad()
def advantages(batch: Batch, trajectories: Sequence[Trajectory], rewards_B: Sequence[float], critic: torch.nn.Module,
               ref: torch.nn.Module | None, cfg: PPOConfig, policy: torch.nn.Module | None = None
               ) -> tuple[Batch, torch.Tensor, torch.Tensor, dict]:
    """(batch with GAE advantages, values_BT, returns_BT, metrics) from the critic's values at collection time.
    With `ref`, the KL penalty compares `policy`'s own logprobs (the trainer's numerics, like the reference's)
    with the reference's: an engine's logprobs differ from the trainer's by float noise, which whitening
    would amplify when the advantages are nearly equal.

    Every forward (critic, policy, reference) runs in the passes the update makes (`loop.no_grad_passes`: by
    `micro_batch_size` or `micro_batch_tokens`): the batch here is the whole step's, several minibatches."""
    if ref is not None and policy is None:
        raise ValueError("the KL penalty needs the policy model, to compare its logprobs with the reference's")
    device = next(critic.parameters()).device
    values_BT = torch.zeros(batch.mask_BT.shape)
    logp_BT, ref_logp_BT = torch.zeros_like(values_BT), torch.zeros_like(values_BT)
    for rows in loop.no_grad_passes(cfg, batch):
        mb = batch.select(rows).to(device)
        T = mb.ids_BT.shape[1]  # the micro-batch's longest row
        with autocast(critic):
            values_BT[rows, :T] = (token_values(critic, mb.ids_BT, mb.attention_BT) * mb.mask_BT).float().cpu()
        if ref is not None:
            with autocast(policy):  # the reference is a copy of the policy: the same compute dtype
                for model, out_BT in ((policy, logp_BT), (ref, ref_logp_BT)):
                    mb_logp_BT, _ = token_logprobs(model, mb.ids_BT, mb.attention_BT, mask_BT=mb.mask_BT)
                    out_BT[rows, :T] = mb_logp_BT.float().cpu()
    rewards_BT = token_rewards(trajectories, rewards_B, batch.ids_BT.shape[1])
    metrics = {}
    if ref is not None:
        rewards_BT = kl_in_reward(rewards_BT, logp_BT, ref_logp_BT, batch.mask_BT, beta=cfg.kl_coef, kind=cfg.kl_kind)
        metrics["kl"] = masked_mean(logp_BT - ref_logp_BT, batch.mask_BT).item()
    adv_BT, returns_BT = gae(rewards_BT, values_BT, batch.mask_BT, gamma=cfg.gamma, lam=cfg.lam)
    metrics.update(advantage_mean=masked_mean(adv_BT, batch.mask_BT).item(),
                   return_mean=masked_mean(returns_BT, batch.mask_BT).item())
    if cfg.whiten_advantages:
        adv_BT = masked_whiten(adv_BT, batch.mask_BT)
    return replace(batch, adv_BT=adv_BT), values_BT, returns_BT, metrics


def update_critic(critic: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, old_values_BT: torch.Tensor,
                  returns_BT: torch.Tensor, cfg: PPOConfig, generator: torch.Generator) -> dict[str, float]:
    """Fit `critic` to `returns_BT` with `optimize` and the value loss, clipped around `old_values_BT`.

    Returns the mean metrics, `loss` and `grad_norm` renamed `value_loss` and `value_grad_norm`."""
    def critic_loss(mb: Batch, rows: torch.Tensor) -> tuple[torch.Tensor, dict]:
        T, device = mb.ids_BT.shape[1], mb.ids_BT.device
        values_BT = token_values(critic, mb.ids_BT, mb.attention_BT)
        return value_loss(values_BT, old_values_BT[rows, :T].to(device), returns_BT[rows, :T].to(device), mb.mask_BT,
                          clip=cfg.value_clip)

    metrics = loop.optimize(critic, optimizer, batch, cfg, generator, critic_loss, "token-mean")
    return {("value_loss" if k == "loss" else "value_grad_norm" if k == "grad_norm" else k): v
            for k, v in metrics.items()}


class PPO:
    """PPO's part of the loop: GAE advantages from the critic as it was at collection, then the policy's and the
    critic's epochs. The critic and its optimizer are part of every checkpoint."""

    def __init__(self, cfg: PPOConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.cfg, self.model, self.optimizer, self.refills = cfg, model, optimizer, 0
        self.critic = make_critic(model)
        self.ref = frozen_copy(model) if cfg.kl_coef > 0 else None
        self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=cfg.critic_lr)
        self.plain_critic = unsharded_copy(self.critic, AutoModelForTokenClassification)  # what checkpoints save

    def keep(self, group: Group) -> bool:
        """A group (usually one episode) with a valid episode that has a training reward: the critic, not the group,
        is the baseline."""
        return len(rewarded(group, self.cfg.reward, skip=CONFIDENCE_SOURCES)[0]) >= 1

    def train_step(self, kept: list[Group], collected: list[Group], step: int) -> dict:
        """GAE advantages from the critic as it was at collection, then the policy's and the critic's epochs."""
        if not kept:
            return {}
        cfg, generator = self.cfg, lambda: torch.Generator().manual_seed(self.cfg.seed + step)
        if cfg.reward.confident:
            score_confidence(self.model, kept)
        scored = [rewarded(g, cfg.reward) for g in kept]
        trajectories, rewards_B = [t for ts, _ in scored for t in ts], [r for _, rs in scored for r in rs]
        batch, values_BT, returns_BT, metrics = advantages(make_batch(trajectories),
                                                           trajectories, rewards_B, self.critic, self.ref, cfg,
                                                           policy=self.model)
        metrics["train_reward"] = sum(rewards_B) / len(rewards_B)
        metrics.update(reward_metrics(collected, cfg.reward))
        metrics.update(loop.update(self.model, None, self.optimizer, batch, cfg, generator()))
        metrics.update(update_critic(self.critic, self.critic_optimizer, batch, values_BT, returns_BT, cfg,
                                     generator()))
        return metrics

    def checkpoint_state(self, sharding: Sharding) -> tuple[dict, dict]:
        """The critic and its optimizer state (gathered on rank 0 when sharded: a collective on every rank)."""
        critic, optimizer_state = sharding.gathered(self.critic, self.critic_optimizer, self.plain_critic)
        return ({"critic_optimizer": optimizer_state}, {"critic": critic}) if sharding.main else ({}, {})

    def restore(self, checkpoint: Path, state: dict) -> None:
        """The critic and its optimizer, from the checkpoint's `critic/`."""
        restore(self.critic, self.critic_optimizer, checkpoint / "critic", state["critic_optimizer"],
                AutoModelForTokenClassification)


def train(cfg: PPOConfig, model: torch.nn.Module, tokenizer: Any, policy: Policy, make_env: Callable[[], TextEnv],
          tasks: list[Task], out_dir: Path, on_step: Callable[[int, dict], None] | None = None,
          periodic_eval: Callable[[int, Callable], dict] | None = None, engines: Engines | None = None,
          sources: int = 0) -> list[dict]:
    """Runs (or resumes, from the latest checkpoint in `out_dir`) PPO on `model`, which `policy` samples
    from after each sync. Same contract as `grpo.train`."""
    torch.manual_seed(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    engines = engines or EnvEngines(make_env)
    return loop.run(cfg, PPO(cfg, model, optimizer), tokenizer, policy, engines, tasks, out_dir,
                    loop.Hooks(on_step, periodic_eval, sources))


class PPOStage(RLStage):
    """`[ppo]`, instead of GRPO: the RL loop with a critic and GAE."""

    def train(self) -> dict[str, Any]:
        run_loop(self.setup, self.setup.job.ppo, train, "PPO")
        return {}
