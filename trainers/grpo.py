"""GRPO for multi-turn tool-using agents, top to bottom.

Each step: collect `tasks_per_step` groups of `group_size` episodes with the rollout engine → drop error
trajectories from the baselines (and, with dynamic sampling, groups whose rewards do not vary) →
group-relative advantages, broadcast onto the sampled tokens → `epochs` passes of minibatch updates of
the chosen policy loss, with the sampler's logprobs as the old logprobs (+ optional KL to a frozen
reference) → weight sync into the engine → metrics and checkpoints. Observation tokens never
contribute: every loss is masked by the trajectory's loss mask.
"""

from __future__ import annotations

import asyncio
import copy
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Callable

import torch
from pydantic import with_config
from transformers import AutoModelForCausalLM

from agentrl.config import STRICT, table_defaults
from agentrl.env.api import TextEnv
from agentrl.policy.protocol import Policy
from agentrl.renderer import Renderer
from agentrl.rollout.engine import RolloutConfig, RolloutEngine, check_loop_rollout
from agentrl.trainers.advantages import ADVANTAGES
from agentrl.trainers.batch import Batch, make_batch
from agentrl.policy.logprobs import token_logprobs
from agentrl.trainers.checkpoint import latest_checkpoint, resume, save_checkpoint
from agentrl.trainers.fsdp import broadcast, data_parallel, full_optimizer_state, gather_into
from agentrl.trainers.losses import KL_KINDS, POLICY_LOSSES, PolicyLossConfig, kl_loss, masked_mean, micro_batch_weight
from agentrl.trainers.metrics import MetricsLogger, rollout_metrics
from agentrl.trainers.rewards import RewardConfig, group_rewards, majority_vote_metrics
from agentrl.types import Group, Task


@with_config(STRICT)
@dataclass(frozen=True)
class GRPOConfig:
    steps: int = 20
    tasks_per_step: int = 8
    rollout: Annotated[RolloutConfig, table_defaults(group_size=8)] = field(
        default_factory=lambda: RolloutConfig(group_size=8))
    advantage: str = "grpo"  # a key of agentrl.trainers.advantages.ADVANTAGES
    reward: RewardConfig = field(default_factory=RewardConfig)  # the training reward: env's, or a mix of sources
    loss: str = "ppo"  # a key of agentrl.trainers.losses.POLICY_LOSSES
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    kl_coef: float = 0.0  # > 0: KL to a frozen copy of the initial policy, as a loss term
    kl_kind: str = "k3"
    lr: float = 1e-5
    epochs: int = 1  # passes over each step's batch
    minibatch_size: int = 16  # trajectories per optimizer step
    micro_batch_size: int | None = None  # trajectories per forward/backward pass (gradient accumulation)
    max_grad_norm: float = 1.0
    dynamic_sampling: bool = False  # skip groups whose rewards are all equal, and refill
    max_refills: int = 2  # extra collection rounds per step when dynamic sampling drops groups
    checkpoint_every: int = 0  # steps; 0 = only at the end
    seed: int = 0

    def __post_init__(self) -> None:
        if self.advantage not in ADVANTAGES:
            raise ValueError(f"advantage must be one of {sorted(ADVANTAGES)}, got {self.advantage!r}")
        if self.loss not in POLICY_LOSSES:
            raise ValueError(f"loss must be one of {sorted(POLICY_LOSSES)}, got {self.loss!r}")
        if self.kl_kind not in KL_KINDS:
            raise ValueError(f"kl_kind must be one of {KL_KINDS}, got {self.kl_kind!r}")
        if self.rollout.group_size < 2:
            raise ValueError("GRPO needs rollout.group_size >= 2 to compare samples of one task")
        check_loop_rollout("grpo", self.rollout)
        if self.micro_batch_size is not None and not 1 <= self.micro_batch_size <= self.minibatch_size:
            raise ValueError(f"micro_batch_size must be in [1, minibatch_size], got {self.micro_batch_size}")


class TaskStream:
    """Tasks in a seeded order, reshuffled each pass; `position` is the data position saved in checkpoints."""

    def __init__(self, tasks: list[Task], seed: int, position: int = 0):
        self.tasks, self.seed, self.position = tasks, seed, position

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(self.seed * 7919 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[Task]:
        """The next `n` tasks, continuing into the next pass (a new order) when this one runs out."""
        out = []
        for _ in range(n):
            epoch, i = divmod(self.position, len(self.tasks))
            if i == 0 or not out:
                order = self._order(epoch)
            out.append(self.tasks[order[i]])
            self.position += 1
        return out


def collect(engine: RolloutEngine, stream: TaskStream, cfg: GRPOConfig) -> tuple[list[Group], list[Group]]:
    """(groups to train on, all groups collected). A group needs two valid episodes to have a baseline (one,
    when groups are single episodes, as in PPO). Dynamic sampling drops groups whose training rewards do
    not vary and collects more, up to `max_refills` extra rounds."""
    collected, kept = [], []
    for _ in range(1 + (cfg.max_refills if cfg.dynamic_sampling else 0)):
        groups = asyncio.run(engine.run(stream.take(cfg.tasks_per_step - len(kept))))
        collected += groups
        kept += [g for g in groups if len(g.valid) >= min(2, cfg.rollout.group_size)  # 1 for PPO's singletons
                 and (not cfg.dynamic_sampling or len(set(group_rewards(g, cfg.reward))) > 1)]
        if len(kept) >= cfg.tasks_per_step:
            break
    return kept, collected


def collect_step(make_env: Callable[[], TextEnv], policy: Policy, renderer: Renderer, stream: TaskStream,
                 cfg: GRPOConfig, step: int) -> tuple[list[Group], list[Group]]:
    """`collect` with this step's rollout seed, on an engine that lives for the step."""
    engine = RolloutEngine(make_env, policy, renderer, replace(cfg.rollout, seed=step_seed(cfg, step)))
    try:
        return collect(engine, stream, cfg)
    finally:
        engine.close()


def step_seed(cfg: GRPOConfig, step: int) -> int:
    """The rollout seed of `step`: distinct per step, and the same on a resumed run."""
    return cfg.seed * 100_003 + step


def to_batch(groups: list[Group], advantage: str, rewards: list[list[float]]) -> Batch:
    """Errors are left out entirely: they are neither in the baseline nor trained on. `rewards[i]` holds
    the training reward of each of `groups[i]`'s valid trajectories. One call over the whole batch, so
    batch-level estimators (REINFORCE++) see every group."""
    trajectories = [t for g in groups for t in g.valid]
    group_ids_B = torch.tensor([i for i, g in enumerate(groups) for _ in g.valid])
    rewards_B = torch.tensor([r for group in rewards for r in group], dtype=torch.float)
    adv_B = ADVANTAGES[advantage](rewards_B, None, group_ids_B)
    return make_batch(trajectories, adv_B.tolist())


def optimize(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, cfg: GRPOConfig,
             generator: torch.Generator, loss_fn: Callable[[Batch, torch.Tensor], tuple[torch.Tensor, dict]],
             agg: str) -> dict[str, float]:
    """`cfg.epochs` passes of shuffled minibatches of `cfg.minibatch_size` trajectories, one optimizer step
    each, with gradient clipping. `loss_fn(micro_batch, rows)` → (loss, metrics), where `rows` indexes
    `batch`. With `cfg.micro_batch_size`, each minibatch is run in micro-batches whose gradients accumulate,
    weighted so that the step equals the whole minibatch's (`micro_batch_weight`). Returns the mean of each
    metric (over micro-batches; grad_norm over steps). PPO's config has the same fields and uses it too.

    In a process group (the trainer sharded with FSDP, `trainers/fsdp.py`), rank r runs rows[r::world] of each
    minibatch, weighted by `world` times their share, since FSDP averages the ranks' gradients."""
    device, totals, counts = next(model.parameters()).device, {}, {}
    rank, world = data_parallel()

    def add(metrics: dict) -> None:
        for k, v in metrics.items():
            totals[k], counts[k] = totals.get(k, 0.0) + float(v), counts.get(k, 0) + 1

    model.train()
    for _ in range(cfg.epochs):
        order = torch.randperm(len(batch), generator=generator)
        for rows in order.split(cfg.minibatch_size):
            optimizer.zero_grad()
            # A rank left without rows still runs one, at weight 0: FSDP's collectives need every rank.
            mine, share = (rows[rank::world], world) if len(rows) > rank else (rows[:1], 0)
            for micro_rows in mine.split(cfg.micro_batch_size or len(rows)):
                loss, metrics = loss_fn(batch.select(micro_rows).to(device), micro_rows)
                (loss * share * micro_batch_weight(batch.mask_BT[micro_rows], batch.mask_BT[rows], agg)).backward()
                add({**metrics, "loss": loss.item()})
            add({"grad_norm": torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm).item()})
            optimizer.step()
    model.eval()
    return {k: totals[k] / counts[k] for k in totals}


def update(model: torch.nn.Module, ref: torch.nn.Module | None, optimizer: torch.optim.Optimizer, batch: Batch,
           cfg: GRPOConfig, generator: torch.Generator) -> dict[str, float]:
    """The policy update: `cfg.loss` on the sampled tokens with the sampler's logprobs as the old ones, plus
    the KL to `ref` as a loss term when given. Also reports, from the first micro-batch (before any update),
    how far the trainer's logprobs are from the sampler's: they must agree."""
    loss_fn, parity = POLICY_LOSSES[cfg.loss], {}

    def policy_loss(mb: Batch, rows: torch.Tensor) -> tuple[torch.Tensor, dict]:
        logp_BT, entropy_BT = token_logprobs(model, mb.ids_BT, mb.attention_BT, True, mb.mask_BT)
        loss, metrics = loss_fn(logp_BT, mb.old_logp_BT, mb.adv_BT, mb.mask_BT, cfg.policy_loss)
        if ref is not None:
            with torch.no_grad():
                ref_logp_BT, _ = token_logprobs(ref, mb.ids_BT, mb.attention_BT, mask_BT=mb.mask_BT)
            kl, kl_metrics = kl_loss(logp_BT, ref_logp_BT, mb.mask_BT, cfg.kl_kind, cfg.policy_loss.agg,
                                     norm_const=cfg.policy_loss.norm_const)
            loss = loss + cfg.kl_coef * kl
            metrics.update(kl_metrics)
        if not parity:
            parity["sampler_logprob_diff_max"] = ((logp_BT.detach() - mb.old_logp_BT).abs() * mb.mask_BT).max().item()
        metrics["entropy"] = masked_mean(entropy_BT.detach(), mb.mask_BT).item()
        return loss, metrics

    return {**optimize(model, optimizer, batch, cfg, generator, policy_loss, cfg.policy_loss.agg), **parity}


def train(cfg: GRPOConfig, model: torch.nn.Module, tokenizer: Any, policy: Policy, make_env: Callable[[], TextEnv],
          tasks: list[Task], out_dir: Path, on_step: Callable[[int, dict], None] | None = None,
          periodic_eval: Callable[[int], dict] | None = None) -> list[dict]:
    """Runs (or resumes, from the latest checkpoint in `out_dir`) GRPO on `model`, which `policy` samples
    from after each sync. Returns the metrics of the steps run now. `periodic_eval(step)` runs after each
    sync; what it returns (e.g. held-out metrics, or {} when not due) is logged under `heldout`."""
    torch.manual_seed(cfg.seed)
    ref = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_coef > 0 else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    stream, start = TaskStream(tasks, cfg.seed), 0
    if (checkpoint := latest_checkpoint(out_dir)) is not None:  # resume: weights, optimizer, RNGs, data
        resumed = resume(model, optimizer, checkpoint)
        start, stream.position = resumed["step"], resumed["state"]["data_position"]

    def train_step(kept: list[Group], collected: list[Group], step: int) -> dict:
        metrics = majority_vote_metrics(collected) if "majority_vote" in cfg.reward.terms else {}
        if kept:
            rewards = [group_rewards(g, cfg.reward) for g in kept]
            metrics["train_reward"] = sum(map(sum, rewards)) / sum(map(len, rewards))
            batch = to_batch(kept, cfg.advantage, rewards)
            metrics.update(update(model, ref, optimizer, batch, cfg, torch.Generator().manual_seed(cfg.seed + step)))
        return metrics

    return run_steps(cfg, model, tokenizer, policy, make_env, stream, start, out_dir, train_step,
                     lambda: ({}, {}), optimizer, on_step, periodic_eval)


def run_steps(cfg: GRPOConfig, model: torch.nn.Module, tokenizer: Any, policy: Policy,
              make_env: Callable[[], TextEnv], stream: TaskStream, start: int, out_dir: Path,
              train_step: Callable[[list[Group], list[Group], int], dict],
              checkpoint_extras: Callable[[], tuple[dict, dict]], optimizer: torch.optim.Optimizer,
              on_step: Callable[[int, dict], None] | None, periodic_eval: Callable[[int], dict] | None) -> list[dict]:
    """The step loop GRPO and PPO share: collect → `train_step(kept, collected, step)` → weight sync →
    metrics (rollout, timing, held-out) → checkpoint, whose extra state and submodels come from
    `checkpoint_extras()`.

    With the trainer sharded over ranks (`trainers/fsdp.py`), rank 0 alone samples, evaluates, logs and
    writes checkpoints: it broadcasts each step's rollouts, every rank trains on its share, and each sync
    gathers the full weights into rank 0's plain copy (`policy` is None on the other ranks).
    Returns the metrics of the steps run."""
    rank, world = data_parallel()
    renderer, plain = Renderer(tokenizer), None
    if world > 1 and rank == 0:  # the sampler's own model when in-process, else a CPU copy to export from
        plain = getattr(policy, "model", None) or AutoModelForCausalLM.from_config(model.config)

    def sync(version: int) -> None:
        if world == 1:
            asyncio.run(policy.sync_weights(model, version))
            return
        gather_into(model, plain)  # every rank takes part
        if rank == 0:
            asyncio.run(policy.sync_weights(plain, version))

    sync(start)
    max_reward = make_env().max_reward
    logger, history = (MetricsLogger(out_dir), []) if rank == 0 else (None, [])
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        rollouts = collect_step(make_env, policy, renderer, stream, cfg, step) if rank == 0 else None
        kept, collected = broadcast(rollouts) if world > 1 else rollouts
        t1 = time.perf_counter()
        metrics = rollout_metrics(collected, max_reward)
        metrics.update(train_step(kept, collected, step))
        t2 = time.perf_counter()
        sync(step + 1)
        t3 = time.perf_counter()
        metrics.update(groups_trained=len(kept), time={"rollout": t1 - t0, "train": t2 - t1, "sync": t3 - t2},
                       tokens_per_s=metrics["sampled_tokens"] / max(t1 - t0, 1e-9))
        if rank == 0:
            if periodic_eval is not None and (heldout := periodic_eval(step + 1)):
                metrics["heldout"] = heldout
            logger.log(step + 1, metrics)
            history.append(metrics)
            if on_step:
                on_step(step + 1, metrics)
        if (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0) or step + 1 == cfg.steps:
            state, submodels = checkpoint_extras()
            optimizer_state = full_optimizer_state(model, optimizer) if world > 1 else None
            if rank == 0:
                save_checkpoint(out_dir, step + 1, plain or model, tokenizer,
                                state={"data_position": stream.position, "weight_version": step + 1, **state},
                                optimizer=None if world > 1 else optimizer, optimizer_state=optimizer_state,
                                submodels=submodels)
    if logger is not None:
        logger.close()
    return history
