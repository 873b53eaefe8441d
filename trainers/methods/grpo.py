"""GRPO for multi-turn tool-using agents: the group's other episodes are each episode's baseline.

Each step of the loop (`trainers/loop.py`): collect `tasks_per_step` groups of `group_size` episodes → drop error
trajectories from the baselines (and, with dynamic sampling, groups whose rewards do not vary, collecting more)
→ group-relative advantages on the sampled tokens → `epochs` passes of minibatch updates of the chosen policy
loss, with the sampler's logprobs as the old logprobs (+ optional KL to a frozen reference) → weight sync into
the engine → metrics and checkpoints. Observation tokens never contribute: every loss is masked by the
trajectory's loss mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
from pydantic import with_config

from agentrl.config import STRICT
from agentrl.env.api import TextEnv
from agentrl.policy.protocol import Policy
from agentrl.rollout.engine import Engines, EnvEngines
from agentrl.trainers import distributed, loop
from agentrl.trainers.advantages import ADVANTAGES
from agentrl.trainers.batch import Batch, make_batch
from agentrl.trainers.distributed import Sharding
from agentrl.trainers.methods.stage import RLStage, run_loop
from agentrl.trainers.rewards import group_rewards, reward_metrics
from agentrl.trainers.rewards.confidence import CONFIDENCE_SOURCES, score_confidence
from agentrl.types import Group, Task


@with_config(STRICT)
@dataclass(frozen=True)
class GRPOConfig(loop.LoopConfig):
    """`[grpo]`: the loop's settings (`LoopConfig`) and GRPO's own."""

    section: ClassVar[str] = "grpo"
    group_size: int = 8  # episodes per task: each one's baseline is the others'
    advantage: str = "grpo"  # a key of agentrl.trainers.advantages.ADVANTAGES
    dynamic_sampling: bool = False  # skip groups whose rewards are all equal, and refill
    # with dynamic sampling, the admission gate: a group's rewards must span at least this (max - min); 0: any spread
    min_reward_spread: float = 0.0
    max_refills: int = 2  # extra collection rounds per step when dynamic sampling drops groups
    # log `toward_better` each step: whether the update moved the policy toward the episodes that beat their group's
    # mean reward (one more forward pass over the batch; a check of the update's sign, whatever the advantage says)
    log_direction: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.advantage not in ADVANTAGES:
            raise ValueError(f"advantage must be one of {sorted(ADVANTAGES)}, got {self.advantage!r}")
        if self.group_size < 2:
            raise ValueError("GRPO needs group_size >= 2 to compare samples of one task")
        if self.min_reward_spread < 0 or (self.min_reward_spread and not self.dynamic_sampling):
            raise ValueError(f"{self.section}.min_reward_spread gates the groups dynamic sampling keeps: set "
                             f"dynamic_sampling = true, and a spread >= 0 (got {self.min_reward_spread})")


def samples_of(group: Group) -> list[Any]:
    """Per valid trajectory, the sample of the group it belongs to: its agent session (from the gateway), whose
    segments are one sample, or itself."""
    return [t.session if t.session is not None else i for i, t in enumerate(group.valid)]


def to_batch(groups: list[Group], advantage: str, rewards: list[list[float | None]]) -> Batch:
    """Errors are left out entirely: they are neither in the baseline nor trained on. `rewards[i]` holds
    the training reward of each of `groups[i]`'s valid trajectories (None: missing, left out too). One call over
    the whole batch, so batch-level estimators (REINFORCE++) see every group. The segments of one agent session
    (`Trajectory.session`, from the gateway) are one sample of the baseline, with their mean reward, and share its
    advantage."""
    trajectories, sample_of, sample_rewards, group_ids = [], [], [], []
    for gi, (group, rewards_of_group) in enumerate(zip(groups, rewards)):
        samples: dict[Any, int] = {}  # the group's samples: agent sessions, or single trajectories
        for t, r, sample in zip(group.valid, rewards_of_group, samples_of(group)):
            if r is None:  # no training reward (a judge that never answered): not in the baseline, not trained
                continue
            if sample not in samples:
                samples[sample] = len(sample_rewards)
                sample_rewards.append([])
                group_ids.append(gi)
            sample_rewards[samples[sample]].append(r)
            trajectories.append(t)
            sample_of.append(samples[sample])
    rewards_S = torch.tensor([sum(r) / len(r) for r in sample_rewards], dtype=torch.float)
    adv_S = ADVANTAGES[advantage](rewards_S, None, torch.tensor(group_ids))
    return make_batch(trajectories, adv_S[torch.tensor(sample_of, dtype=torch.long)].tolist())


def beats(rewards: list[list[float | None]]) -> torch.Tensor:
    """Each trained row's reward minus its group's mean, the rows as `to_batch` lays them out."""
    rows = []
    for group in rewards:
        present = [r for r in group if r is not None]
        rows += [r - sum(present) / len(present) for r in present]
    return torch.tensor(rows, dtype=torch.float)


class GRPO:
    """GRPO's part of the loop: group-relative advantages over each kept group's training rewards."""

    def __init__(self, cfg: GRPOConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.cfg, self.model, self.optimizer = cfg, model, optimizer
        self.ref = distributed.frozen_copy(model) if cfg.kl_coef > 0 else None
        self.refills = cfg.max_refills if cfg.dynamic_sampling else 0  # collection rounds for the groups dropped

    def keep(self, group: Group) -> bool:
        """A group with a baseline (two valid episodes, or agent sessions, with a training reward) and, with dynamic
        sampling, rewards that vary (by at least `min_reward_spread`). The policy's confidence is scored later, at training time: it never misses, and
        varies whenever the responses do."""
        rewards = group_rewards(group, self.cfg.reward, skip=CONFIDENCE_SOURCES)
        samples = {s for s, r in zip(samples_of(group), rewards) if r is not None}
        present = [r for r in rewards if r is not None]
        spread = max(present) - min(present) if present else 0.0
        varied = spread > 0 and spread >= self.cfg.min_reward_spread or self.cfg.reward.confident
        return len(samples) >= 2 and (not self.cfg.dynamic_sampling or varied)

    def train_step(self, kept: list[Group], collected: list[Group], step: int) -> dict:
        """One policy update on the kept groups' advantages; the reward sources' own metrics (majority vote,
        judge)."""
        cfg = self.cfg
        if cfg.reward.confident:
            score_confidence(self.model, kept)
        metrics = reward_metrics(collected, cfg.reward)
        if kept:
            rewards = [group_rewards(g, cfg.reward) for g in kept]
            present = [r for rs in rewards for r in rs if r is not None]
            metrics["train_reward"] = sum(present) / len(present)
            batch = to_batch(kept, cfg.advantage, rewards)
            metrics.update(loop.update(self.model, self.ref, self.optimizer, batch, cfg,
                                       torch.Generator().manual_seed(cfg.seed + step)))
            if cfg.log_direction:
                metrics["toward_better"] = loop.toward_better(self.model, batch, beats(rewards), cfg)
        return metrics

    def checkpoint_state(self, sharding: Sharding) -> tuple[dict, dict]:
        """Nothing beyond the policy: the reference model is the initial policy, rebuilt on resume (it is copied
        before the loop restores the checkpoint)."""
        return {}, {}

    def restore(self, checkpoint: Path, state: dict) -> None:
        """Nothing to restore (see `checkpoint_state`)."""


def train(cfg: GRPOConfig, model: torch.nn.Module, tokenizer: Any, policy: Policy, make_env: Callable[[], TextEnv],
          tasks: list[Task], out_dir: Path, on_step: Callable[[int, dict], None] | None = None,
          periodic_eval: Callable[[int, Callable], dict] | None = None, engines: Engines | None = None,
          sources: int = 0) -> list[dict]:
    """Runs (or resumes, from the latest checkpoint in `out_dir`) GRPO on `model`, which `policy` samples
    from after each sync. Returns the metrics of the steps run now (`loop.run`). With `engines`
    (`agentrl.gateway.agents.AgentEngines`) the episodes are an agent program's, through the gateway."""
    torch.manual_seed(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    engines = engines or EnvEngines(make_env)
    return loop.run(cfg, GRPO(cfg, model, optimizer), tokenizer, policy, engines, tasks, out_dir,
                    loop.Hooks(on_step, periodic_eval, sources))


class GRPOStage(RLStage):
    """`[grpo]`, the default: the RL loop with group-relative advantages."""

    def train(self) -> dict[str, Any]:
        run_loop(self.setup, self.setup.job.grpo, train, "GRPO")
        return {}
