"""The one step loop of RL training, and what every RL method shares.

    for step in range(start, cfg.steps):
        kept, collected, flow = rollouts.take(step)  # groups of episodes from the engine; async: their staleness
        metrics = method.train_step(kept, collected, step)
        rollouts.sync(step + 1)                    # the new weights, version step + 1, into the engine
        log(metrics)                               # rollout, training, timing, idle fractions, held-out
        checkpoint when due                        # the policy, its optimizer, the data position, the method's state

A method (`grpo.GRPO`, `ppo.PPO`, `tango.Tango`) supplies the model it trains and its optimizer, `train_step` and
what its checkpoints keep beyond the policy; which groups it trains on is its `keep` rule (and `refills`).
Where the groups come from is `cfg.max_staleness`'s choice:
`Synchronous` (0) collects each step's groups after the previous sync, with sharding over ranks behind `Sharding`
(in one process every call is plain; with FSDP, rank 0 alone samples, evaluates, logs and writes checkpoints);
`Asynchronous` (k > 0) keeps a `RolloutSource` playing up to k steps ahead of the trainer in another thread.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, ClassVar, Coroutine, Protocol

import torch
from pydantic import with_config

from agentrl.config import STRICT
from agentrl.policy.logprobs import token_logprobs
from agentrl.policy.precision import autocast
from agentrl.policy.protocol import Policy
from agentrl.renderer import Renderer
from agentrl.rollout import seeds
from agentrl.rollout.buffer import GroupBuffer, group_position, group_version
from agentrl.rollout.engine import Engines, RolloutConfig
from agentrl.rollout.ray_source import RaySources
from agentrl.rollout.source import RolloutSource
from agentrl.rollout.timeline import Timeline, idle_fractions
from agentrl.trainers import distributed
from agentrl.trainers.batch import Batch, token_micro_batches
from agentrl.trainers.tasks import Curriculum, CurriculumConfig, TaskStream
from agentrl.trainers.distributed import Sharding, resume
from agentrl.trainers.losses import (ADVANTAGE_WEIGHTED, KL_KINDS, POLICY_LOSSES, CorrectionConfig, PolicyLossConfig,
                                     kl_loss, masked_mean, micro_batch_weight, rollout_correction)
from agentrl.trainers.metrics import MetricsLogger, check_step, rollout_metrics
from agentrl.trainers.rewards import RewardConfig
from agentrl.types import Group, Task


@with_config(STRICT)
@dataclass(frozen=True)
class LoopConfig:
    """The settings of every RL loop; `GRPOConfig` and `PPOConfig` add their own (and their defaults)."""

    section: ClassVar[str] = "rl"  # the recipe table, for error messages
    steps: int = 20  # training steps: collect, update, sync
    tasks_per_step: int = 8  # tasks collected per step, `group_size` episodes each
    group_size: int = 1  # episodes per task: a group (the same env seed, different samples)
    # the episodes' budgets, parser and timeouts; its group_size is `group_size`, its seed derived from `seed`
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)  # the training reward: env's, or a mix of sources
    loss: str = "ppo"  # a key of agentrl.trainers.losses.POLICY_LOSSES
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    # the sampler/trainer correction: decoupled PPO, TIS, MIS (off: the sampler's logprobs are PPO's old ones); a
    # recipe with a vLLM engine and no such table gets one on (`trainers/job/recipe.py`, `engine_correction`)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    kl_coef: float = 0.0  # > 0: KL to a frozen copy of the initial policy
    kl_kind: str = "k3"  # one of KL_KINDS
    lr: float = 1e-5  # AdamW's learning rate for the policy
    epochs: int = 1  # passes over each step's batch
    minibatch_size: int = 16  # trajectories per optimizer step
    micro_batch_size: int | None = None  # trajectories per forward/backward pass (gradient accumulation)
    # or instead: tokens per pass (rows x the longest, rows sorted by length; a longer row goes alone)
    micro_batch_tokens: int | None = None
    max_grad_norm: float = 1.0  # gradients clipped to this global norm
    checkpoint_every: int = 0  # steps; 0 = only at the end
    seed: int = 0  # the task order, the rollout seeds, the minibatch shuffles
    # > 0: rollouts run up to this many weight versions ahead of the trainer (asynchronous training, in one
    # process); groups whose oldest token is older are dropped. 0: collect, train, sync (synchronous)
    max_staleness: int = 0
    # asynchronous: episodes in flight at a weight update take their next turn with the new weights (each turn
    # records its version); false: they are aborted and played again from the start with the new weights
    partial_rollouts: bool = True
    curriculum: CurriculumConfig | None = None  # draw tasks by their measured pass rates (trainers/curriculum.py)

    def __post_init__(self) -> None:
        counts = {"steps": (self.steps, 0), "checkpoint_every": (self.checkpoint_every, 0), "epochs": (self.epochs, 1),
                  "tasks_per_step": (self.tasks_per_step, 1), "minibatch_size": (self.minibatch_size, 1)}
        if wrong := [f"{name} must be >= {low}, got {value}" for name, (value, low) in counts.items() if value < low]:
            raise ValueError(f"{self.section}: {'; '.join(wrong)} (steps = 0: no RL stage; checkpoint_every = 0: "
                             "only at the end)")
        if not self.lr > 0 or not self.max_grad_norm > 0:
            raise ValueError(f"{self.section}.lr and max_grad_norm must be > 0, got {self.lr} and {self.max_grad_norm}")
        if self.loss not in POLICY_LOSSES:
            raise ValueError(f"loss must be one of {sorted(POLICY_LOSSES)}, got {self.loss!r}")
        if self.kl_kind not in KL_KINDS:
            raise ValueError(f"kl_kind must be one of {KL_KINDS}, got {self.kl_kind!r}")
        if self.micro_batch_size is not None and not 1 <= self.micro_batch_size <= self.minibatch_size:
            raise ValueError(f"micro_batch_size must be in [1, minibatch_size], got {self.micro_batch_size}")
        if self.micro_batch_tokens is not None and (self.micro_batch_tokens < 1 or self.micro_batch_size is not None):
            raise ValueError(f"{self.section}.micro_batch_tokens must be >= 1, and replaces micro_batch_size (set one "
                             f"of them), got {self.micro_batch_tokens} with micro_batch_size = {self.micro_batch_size}")
        if self.max_staleness < 0:
            raise ValueError(f"{self.section}.max_staleness must be >= 0 (0: synchronous), got {self.max_staleness}")
        if not self.partial_rollouts and not self.max_staleness:
            raise ValueError(f"{self.section}.partial_rollouts = false aborts the episodes in flight at a weight "
                             "update, which only asynchronous training has: set max_staleness > 0, or remove it")
        if self.correction.tis is not None and self.loss not in ADVANTAGE_WEIGHTED:
            raise ValueError(f"{self.section}.correction.tis folds the weight into the advantage, which is exact for "
                             f"the ppo and gspo losses only ({self.loss!r} reads the advantage itself): use "
                             "correction.mis, or loss = 'ppo'")
        if self.curriculum and self.max_staleness:
            raise ValueError(f"{self.section}.curriculum draws each step's tasks by the pass rates of the steps before "
                             "it, which asynchronous rollouts run ahead of: remove max_staleness or the curriculum")
        check_loop_rollout(self.section, self.rollout)


def check_loop_rollout(section: str, rollout: RolloutConfig) -> None:
    """A training loop plays `section.group_size` episodes per task and derives each collection's rollout seed from
    `section.seed` (distinct per step, the same on a resumed run): either set in `[section.rollout]` would be
    replaced, so it is an error."""
    if rollout.group_size != 1:
        raise ValueError(f"{section}.rollout.group_size: the group is the method's, set {section}.group_size instead")
    if rollout.seed != 0:
        raise ValueError(f"{section}.rollout.seed is derived from {section}.seed (per step, the same on a resumed "
                         f"run): set {section}.seed instead")


class Method(Protocol):
    """What an RL method gives the loop: the policy it trains and its optimizer, which groups it trains on (`keep`,
    with up to `refills` more collection rounds per step for the ones it dropped), its step, and what its
    checkpoints keep beyond the policy."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    refills: int

    def keep(self, group: Group) -> bool:
        """Whether to train on `group`."""

    def train_step(self, kept: list[Group], collected: list[Group], step: int) -> dict:
        """Update on the groups kept (all collected ones are there for metrics); returns the step's metrics."""

    def checkpoint_state(self, sharding: Sharding) -> tuple[dict, dict]:
        """(state, submodels) to save beyond the policy and its optimizer, e.g. a critic (a collective when
        sharded: every rank calls it)."""

    def restore(self, checkpoint: Path, state: dict) -> None:
        """Load what `checkpoint_state` saved, on resuming from `checkpoint`."""


def collect(engines: Engines, policy: Policy, renderer: Renderer, stream: TaskStream,
            cfg: LoopConfig, step: int, keep: Callable[[Group], bool], refills: int = 0,
            timeline: Timeline | None = None) -> tuple[list[Group], list[Group]]:
    """(groups to train on, all groups collected) of `step`: `tasks_per_step` tasks, then up to `refills` more
    rounds for the groups that `keep` dropped, on an engine from `engines` (`EnvEngines`, `AgentEngines`) that lives
    for the step."""
    collected, kept = [], []
    with engines(policy, renderer, replace(cfg.rollout, group_size=cfg.group_size, seed=seeds.step_seed(cfg.seed, step)), timeline) as engine:
        for _ in range(1 + refills):
            groups = asyncio.run(engine.run(stream.take(cfg.tasks_per_step - len(kept))))
            collected += groups
            kept += [g for g in groups if keep(g)]
            if len(kept) >= cfg.tasks_per_step:
                break
    return kept, collected


class Synchronous:
    """`max_staleness = 0`: each step's groups are collected after the previous step's sync (`collect`), on rank 0
    when sharded. The data position is the stream's."""

    def __init__(self, sharding: Sharding, engines: Engines, renderer: Renderer, stream: TaskStream,
                 cfg: LoopConfig, method: Method, timeline: Timeline):
        self.sharding, self.stream, self.max_reward = sharding, stream, engines.max_reward
        self._collect = lambda step: collect(engines, sharding.policy, renderer, stream, cfg, step, method.keep,
                                             method.refills, timeline)

    def start(self, version: int) -> None:
        """The trainer's weights into the engine as `version`."""
        self.sharding.sync(version)

    def take(self, step: int) -> tuple[list[Group], list[Group], dict]:
        """(groups to train on, all collected, metrics of the flow) of `step`."""
        kept, collected = self.sharding.from_main(lambda: self._collect(step))
        self.sharding.release_engine()
        return kept, collected, self.stream.observe(collected, self.max_reward)

    def sync(self, version: int) -> None:
        """The new weights into the engine."""
        self.sharding.sync(version)

    def state(self) -> dict:
        """The data position a checkpoint keeps (and a curriculum's pass rates)."""
        return self.stream.state()

    @staticmethod
    def run(coroutine: Coroutine) -> Any:
        """Runs `coroutine` (a held-out evaluation's episodes) to its end: nothing else samples between steps."""
        return asyncio.run(coroutine)

    def close(self) -> None:
        """Nothing runs between steps."""


class Asynchronous:
    """`max_staleness = k > 0`: a `RolloutSource` plays episodes up to k steps ahead of the trainer, in another thread
    (or `sources` of them in Ray actors, `RaySources`), with its own copy of the weights (the in-process sampler must
    not share the trainer's model); each step takes the oldest kept groups within k versions. The data position is the
    first task position not done (trained, refused or dropped as stale) and those done above it: a resumed run replays
    the rest."""

    def __init__(self, method: Method, sharding: Sharding, engines: Engines, renderer: Renderer, stream: TaskStream,
                 cfg: LoopConfig, timeline: Timeline, state: dict, sources: int = 0):
        if sharding.sharded:
            raise ValueError(f"{cfg.section}.max_staleness > 0 runs in one process: set it to 0 under torchrun")
        policy = sharding.policy
        if getattr(policy, "model", None) is method.model:
            raise ValueError("asynchronous training needs the in-process sampler on its own copy of the model (it "
                             "samples while the trainer steps): give HFPolicy a copy, as `agentrl train` does")
        self.model, self.policy, self.cfg = method.model, policy, cfg
        self.position, self.done = state.get("data_position", 0), set(state.get("done_positions", ()))
        self.buffer = GroupBuffer(method.keep, cfg.max_staleness, shares=max(sources, 1))
        source = partial(RaySources, sources) if sources else RolloutSource  # Ray actors, or a thread of this process
        self.source = source(engines, policy, renderer, replace(cfg.rollout, group_size=cfg.group_size), stream.at,
                             self.buffer,
                             tasks_per_step=cfg.tasks_per_step, seed=cfg.seed, start=self.position, skip=self.done,
                             timeline=timeline, restart=not cfg.partial_rollouts)
        self.give_up_after = cfg.tasks_per_step * (1 + method.refills)

    def start(self, version: int) -> None:
        """The trainer's weights into the engine as `version`, then the source starts playing."""
        asyncio.run(self.policy.sync_weights(self.model, version))
        self.source.start()

    def take(self, step: int) -> tuple[list[Group], list[Group], dict]:
        """(groups to train on, all that finished since the last take, metrics of the flow) for the weights of
        version `step`: the staleness of the groups trained, those dropped, those in flight and waiting."""
        taken = self.buffer.take(self.cfg.tasks_per_step, step, self.give_up_after)
        self.done.update(taken.done)
        while self.position in self.done:
            self.done.remove(self.position)
            self.position += 1
        staleness = Counter(step - group_version(g) for g in taken.kept)
        trained = {group_position(g) for g in taken.kept}
        flow = {"staleness": {str(k): staleness[k] for k in sorted(staleness)}, "stale_groups": len(taken.stale),
                "groups_in_flight": self.source.in_flight, "groups_waiting": self.buffer.ready(),
                "restarted_groups_total": self.source.restarted,
                "positions": {"trained": sorted(trained), "dropped": sorted(set(taken.done) - trained)}}
        return taken.kept, taken.collected, flow

    def sync(self, version: int) -> None:
        """The new weights into the engine; episodes in flight take their next turn with them."""
        self.source.sync(self.model, version)

    def state(self) -> dict:
        """The data position a checkpoint keeps."""
        return {"data_position": self.position, "done_positions": sorted(self.done)}

    def run(self, coroutine: Coroutine) -> Any:
        """Runs `coroutine` (a held-out evaluation's episodes) on the source's event loop, beside its rollouts: the
        engine's connections belong to that loop. No sync comes until it ends (the trainer waits for it), so every
        episode of it samples from this step's weights."""
        return self.source.run(coroutine)

    def close(self) -> None:
        """Stop the source (episodes in flight are dropped: a resumed run replays them)."""
        self.source.close()


def optimize(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, cfg: LoopConfig,
             generator: torch.Generator, loss_fn: Callable[[Batch, torch.Tensor], tuple[torch.Tensor, dict]],
             agg: str, inert_B: torch.Tensor | None = None) -> dict[str, float]:
    """`cfg.epochs` passes of shuffled minibatches of `cfg.minibatch_size` trajectories, one clipped optimizer step
    each; `loss_fn(micro_batch, rows)` -> (loss, metrics), `rows` indexing `batch`. Micro-batches (`micro_batch_size`
    rows, or `micro_batch_tokens` by `token_micro_batches`) accumulate gradients weighted so that the step equals the
    whole minibatch's. Returns each metric's mean.

    Rows marked in `inert_B` add nothing to the loss or its gradient, only to the minibatch's normalizer: they get
    no forward pass, and a minibatch of only such rows makes no optimizer step (AdamW's momentum alone would move
    the weights). The step is the same as with them; `skipped_rows_frac` is their share.

    Sharded (FSDP, `trainers/distributed.py`), the minibatch is cut into passes of `world` micro-batches; rank r runs
    rows[r::world] of each, weighted by `world` times their share, since FSDP averages the ranks' gradients."""
    device, totals, counts, ranks = next(model.parameters()).device, {}, {}, distributed.current()

    def add(metrics: dict) -> None:
        for k, v in metrics.items():
            totals[k], counts[k] = totals.get(k, 0.0) + float(v), counts.get(k, 0) + 1

    model.train()
    for _ in range(cfg.epochs):
        order = torch.randperm(len(batch), generator=generator)
        for rows in order.split(cfg.minibatch_size):
            active = rows if inert_B is None else rows[~inert_B[rows]]
            add({"skipped_rows_frac": 1 - len(active) / len(rows)})
            if not len(active):
                continue
            optimizer.zero_grad()
            for pass_rows in passes(cfg, batch, active, ranks.world):  # the same number on every rank
                micro_rows, share = ranks.share(pass_rows)
                with autocast(model):  # the compute dtype, over float32 master weights (if marked)
                    loss, metrics = loss_fn(batch.select(micro_rows).to(device), micro_rows)
                (loss * share * micro_batch_weight(batch.mask_BT[micro_rows], batch.mask_BT[rows], agg)).backward()
                add({**metrics, "loss": loss.item()})
            add({"grad_norm": torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm).item()})
            optimizer.step()
    model.eval()
    return {k: totals[k] / counts[k] for k in totals}


@torch.no_grad()
def passes(cfg: LoopConfig, batch: Batch, rows: torch.Tensor, world: int = 1) -> list[torch.Tensor]:
    """`rows` of `batch` (one minibatch) cut into forward passes: by `micro_batch_tokens` (`token_micro_batches`),
    else `world` × `micro_batch_size` rows at a time, else all at once; each rank then takes its share."""
    if cfg.micro_batch_tokens is not None:
        return token_micro_batches(rows, batch.attention_BT[rows].sum(-1), cfg.micro_batch_tokens, world)
    return list(rows.split(world * cfg.micro_batch_size)) if cfg.micro_batch_size else [rows]


def no_grad_passes(cfg: LoopConfig, batch: Batch) -> list[torch.Tensor]:
    """Every row of a whole step's `batch` in the forward passes an update would make of it (a minibatch's worth at
    most), for the passes without gradients before the update (PPO's values, decoupled PPO's old logprobs)."""
    return [p for rows in torch.arange(len(batch)).split(cfg.minibatch_size) for p in passes(cfg, batch, rows)]


@torch.no_grad()  # else each pass's graph would live as long as the logprobs: the whole update
def model_logprobs(model: torch.nn.Module, batch: Batch, cfg: LoopConfig) -> torch.Tensor:
    """`model`'s logprobs of `batch`'s sampled tokens (0 elsewhere), in `no_grad_passes`, in eval mode (dropout
    off, like the sampler) and its compute dtype (the trainer's: PPO's ratio starts at 1). The trainer's for decoupled
    PPO, a teacher's for distillation. Sharded, every rank runs every row: the forwards stay matched."""
    device, logp_BT = next(model.parameters()).device, torch.zeros_like(batch.old_logp_BT)
    model.eval()
    for rows in no_grad_passes(cfg, batch):
        mb = batch.select(rows).to(device)
        with autocast(model):
            mb_logp_BT, _ = token_logprobs(model, mb.ids_BT, mb.attention_BT, mask_BT=mb.mask_BT)
        logp_BT[rows, :mb_logp_BT.shape[1]] = mb_logp_BT.float().cpu()
    return logp_BT


def update(model: torch.nn.Module, ref: torch.nn.Module | None, optimizer: torch.optim.Optimizer, batch: Batch,
           cfg: LoopConfig, generator: torch.Generator) -> dict[str, float]:
    """The policy update: `cfg.loss` on the sampled tokens, plus the KL to `ref` as a loss term when given.

    PPO's old logprobs are the sampler's; with `cfg.correction.decoupled`, the trainer's own, recomputed before
    the epochs (`decoupled`: decoupled PPO), and the sampler's enter only through the TIS weight and the MIS mask
    (`rollout_correction`); the step then logs their mismatch over the rows it trains. Either way it reports
    `sampler_logprob_diff_max`, the largest |trainer - sampler| before any update: they must nearly agree."""
    # Without a KL term, a row whose advantages are all 0 adds nothing to these losses' gradients (the covariance
    # losses' statistics span the batch); when most groups' rewards do not vary, that is most rows.
    skippable = ref is None and cfg.loss in ADVANTAGE_WEIGHTED
    loss_fn, first = POLICY_LOSSES[cfg.loss], {}
    if cfg.correction.decoupled:
        batch, first = decoupled(model, batch, cfg, inert(batch) if skippable else None)

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
        first.setdefault("sampler_logprob_diff_max",
                         ((logp_BT.detach() - mb.old_logp_BT).abs() * mb.mask_BT).max().item())
        metrics["entropy"] = masked_mean(entropy_BT.detach(), mb.mask_BT).item()
        return loss, metrics

    inert_B = inert(batch) if skippable else None
    return {**optimize(model, optimizer, batch, cfg, generator, policy_loss, cfg.policy_loss.agg, inert_B), **first}


def toward_better(model: torch.nn.Module, batch: Batch, beat_B: torch.Tensor, cfg: LoopConfig) -> float:
    """The direction an update took, measured: Σ over rows of `beat_B` (the row's reward minus its group's mean,
    raw rewards, not advantages) × the change of the row's summed logprob from the sampler's to `model`'s now, over
    the rows. > 0: the policy moved toward the episodes that did better, < 0: away (a sign error anywhere between
    the rewards and the optimizer). One forward pass over the batch."""
    dlogp_B = ((model_logprobs(model, batch, cfg) - batch.old_logp_BT) * batch.mask_BT).sum(-1)
    return (beat_B * dlogp_B).sum().item() / len(batch)


def inert(batch: Batch) -> torch.Tensor:
    """The rows whose advantages are all 0 on their sampled tokens."""
    return (batch.adv_BT * batch.mask_BT == 0).all(-1)


def decoupled(model: torch.nn.Module, batch: Batch, cfg: LoopConfig, skip_B: torch.Tensor | None
              ) -> tuple[Batch, dict[str, float]]:
    """Decoupled PPO: the trainer's own logprobs, recomputed before the epochs, become PPO's old ones, and the
    sampler's enter only through the TIS weight and the MIS mask (`rollout_correction`), with their metrics over the
    rows recomputed. Rows in `skip_B` (those the update skips) are not: they keep the sampler's logprobs."""
    rows = torch.arange(len(batch)) if skip_B is None else (~skip_B).nonzero().flatten()
    if not len(rows):
        return batch, {}
    sub = batch.select(rows)
    T, trainer_RT = sub.ids_BT.shape[1], model_logprobs(model, sub, cfg)
    adv_RT, mask_RT, metrics = rollout_correction(trainer_RT, sub.old_logp_BT, sub.adv_BT, sub.mask_BT, cfg.correction)
    metrics["sampler_logprob_diff_max"] = ((trainer_RT - sub.old_logp_BT).abs() * sub.mask_BT).max().item()
    old_BT, adv_BT, mask_BT = batch.old_logp_BT.clone(), batch.adv_BT.clone(), batch.mask_BT.clone()
    old_BT[rows, :T], adv_BT[rows, :T], mask_BT[rows, :T] = trainer_RT, adv_RT, mask_RT
    return replace(batch, old_logp_BT=old_BT, adv_BT=adv_BT, mask_BT=mask_BT), metrics


@dataclass(frozen=True)
class Hooks:
    """What the job adds to the loop: a line per step, held-out evaluations, and where asynchronous rollouts run."""

    # after each step, on rank 0: the step and its metrics (the progress line)
    on_step: Callable[[int, dict], None] | None = None
    # after each sync: (step, execute) -> held-out metrics, or {} when none is due; the episodes' coroutine is
    # given to `execute` (the event loop the engine samples on); what it returns is logged under `heldout`
    periodic_eval: Callable[[int, Callable[[Coroutine], Any]], dict] | None = None
    sources: int = 0  # asynchronous training: rollout sources in this many Ray actors (`[ray] sources`), else a thread


class StepClock:
    """The timing of one step: its phases' seconds, throughput, and the engine's, envs' and trainer's busy intervals
    with their idle fractions (what `agentrl report` draws)."""

    def __init__(self, timeline: Timeline, asynchronous: bool):
        self.timeline, self.asynchronous, self.laps = timeline, asynchronous, [time.perf_counter()]

    def lap(self) -> None:
        """The end of a phase: rollout, train, sync."""
        self.laps.append(time.perf_counter())

    def metrics(self, metrics: dict, kept: list[Group]) -> dict:
        """The step's timing metrics, given its other metrics and the groups it trained on."""
        t0, t1, t2, t3 = self.laps
        busy, trained = self.timeline.cut(), sum(t.num_sampled for g in kept for t in g.valid)
        rollout_s = t3 - t0 if self.asynchronous else t1 - t0  # asynchronous: sampled all through the step
        return dict(groups_trained=len(kept), tokens_per_s=metrics["sampled_tokens"] / max(rollout_s, 1e-9),
                    trained_tokens=trained, trained_tokens_per_s=trained / max(t3 - t0, 1e-9),
                    time={**metrics.get("time", {}), "rollout": t1 - t0, "train": t2 - t1, "sync": t3 - t2},
                    timeline=busy, idle=idle_fractions(busy, t0 - self.timeline.origin, t3 - self.timeline.origin))


def run(cfg: LoopConfig, method: Method, tokenizer: Any, policy: Policy, engines: Engines, tasks: list[Task],
        out_dir: Path, hooks: Hooks = Hooks()) -> list[dict]:
    """Runs (or resumes, from the latest checkpoint in `out_dir`) `cfg.steps` steps of `method` on `method.model`,
    with episodes from `engines` (`EnvEngines` of the job's envs, or `AgentEngines`: agent programs through the
    gateway) on `tasks`, sampled by `policy`; returns the metrics of the steps run now."""
    resumed = resume(method.model, method.optimizer, out_dir, method.restore)  # weights, optimizer, RNGs, state
    start, saved = (resumed["step"], resumed["state"]) if resumed else (0, {"data_position": 0})
    stream = (Curriculum(tasks, cfg.seed, cfg.curriculum, saved.get("curriculum")) if cfg.curriculum
              else TaskStream(tasks, cfg.seed, saved["data_position"]))
    sharding, renderer, timeline = Sharding(method.model, policy), Renderer(tokenizer), Timeline()
    rollouts = (Asynchronous(method, sharding, engines, renderer, stream, cfg, timeline, saved, hooks.sources)
                if cfg.max_staleness else Synchronous(sharding, engines, renderer, stream, cfg, method, timeline))
    rollouts.start(start)
    logger, history = MetricsLogger(out_dir, start) if sharding.main else None, []
    try:
        for step in range(start, cfg.steps):
            clock = StepClock(timeline, asynchronous=cfg.max_staleness > 0)
            kept, collected, flow = rollouts.take(step)
            clock.lap()
            with timeline.trainer:
                metrics = {**rollout_metrics(collected, engines.max_reward), **flow,
                           **method.train_step(kept, collected, step)}
            check_step(f"step {step + 1}", metrics)
            clock.lap()
            rollouts.sync(step + 1)
            clock.lap()
            metrics.update(clock.metrics(metrics, kept))
            if sharding.main:
                history.append(log_step(step + 1, metrics, logger, hooks, rollouts.run))
            if step + 1 == cfg.steps or (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0):
                save_checkpoint(step + 1, method, sharding, rollouts, out_dir, tokenizer)
    finally:
        rollouts.close()
        if logger is not None:
            logger.close()
    return history


def save_checkpoint(step: int, method: Method, sharding: Sharding, rollouts: Synchronous | Asynchronous,
                    out_dir: Path, tokenizer: Any) -> None:
    """Checkpoint `step`: the policy as synced, its optimizer, the data position, the weight version and the method's
    state (a collective when sharded: every rank calls it)."""
    state, submodels = method.checkpoint_state(sharding)
    sharding.save_checkpoint(out_dir, step, tokenizer, method.optimizer,
                             {**rollouts.state(), "weight_version": step, **state}, submodels)


def log_step(step: int, metrics: dict, logger: MetricsLogger, hooks: Hooks, execute: Callable[[Coroutine], Any]
             ) -> dict:
    """Rank 0's end of a step: its held-out evaluation when one is due (run by `execute`), its metrics logged, its
    progress line; returns the metrics."""
    if hooks.periodic_eval is not None and (heldout := hooks.periodic_eval(step, execute)):
        metrics["heldout"] = heldout
    logger.log(step, metrics)
    if hooks.on_step:
        hooks.on_step(step, metrics)
    return metrics
