"""On-policy distillation: the student samples, a frozen teacher scores the student's own tokens, and the per-token
reverse KL is the training signal (GKD, Agarwal et al. 2024; Thinking Machines' "On-Policy Distillation", 2025).

Each step of the loop (`trainers/loop.py`): collect `tasks_per_step` groups of `group_size` episodes from the
student, multi-turn and with tool calls as in GRPO → the teacher's logprob of every sampled token (exactly the loss
mask: the env's tokens are neither the student's nor scored) → each token's advantage log pi_teacher -
log pi_student (`distillation_advantages`; the student's logprobs are the sampler's, of the tokens it sampled),
plus `reward_coef` × the group-relative advantage of the training reward when set → the chosen policy loss →
weight sync. Unlike SFT on the teacher's episodes, the student learns on the states it reaches itself, and every
token gets a signal, not one reward per episode.

The teacher is a model folder with the student's tokenizer (a token id must mean the same text to both: checked
when the job starts), frozen, beside the trainer in the trainer's compute dtype.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch
from pydantic import with_config
from transformers import AutoModelForCausalLM

from agentrl.config import STRICT
from agentrl.env.api import TextEnv
from agentrl.models.tokenizer import load_tokenizer
from agentrl.policy.precision import compute_dtype, mixed_precision
from agentrl.policy.protocol import Policy
from agentrl.rollout.engine import Engines, EnvEngines
from agentrl.trainers import distributed, loop
from agentrl.trainers.advantages import ADVANTAGES, distillation_advantages
from agentrl.trainers.distributed import Sharding
from agentrl.trainers.losses import masked_mean
from agentrl.trainers.methods.grpo import to_batch
from agentrl.trainers.methods.stage import RLStage, run_loop
from agentrl.trainers.rewards import group_rewards, reward_metrics
from agentrl.types import Group, Task

if TYPE_CHECKING:
    from agentrl.trainers.job.recipe import TrainJob


@with_config(STRICT)
@dataclass(frozen=True)
class DistillConfig(loop.LoopConfig):
    """`[distill]`: the loop's settings (`LoopConfig`), the teacher, and how much of the env's reward to mix in."""

    section: ClassVar[str] = "distill"
    teacher: str = ""  # the teacher's model folder (or hub name), with the student's tokenizer
    # weight of the training reward's group-relative advantage added to every sampled token's; 0: distillation only
    reward_coef: float = 0.0
    advantage: str = "grpo"  # the reward's estimator (a key of ADVANTAGES), with reward_coef > 0

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = []
        if not self.teacher:
            problems.append("teacher is required: the folder of the model to distill from (e.g. a trained run's "
                            "final_model), with the student's tokenizer")
        if self.reward_coef < 0:
            problems.append(f"reward_coef must be >= 0, got {self.reward_coef}")
        if self.reward_coef > 0 and self.group_size < 2:
            problems.append("reward_coef > 0 compares each episode's reward with its group's: set group_size >= 2")
        if self.advantage not in ADVANTAGES:
            problems.append(f"advantage must be one of {sorted(ADVANTAGES)}, got {self.advantage!r}")
        if problems:
            raise ValueError("invalid [distill]: " + "; ".join(problems))


def same_vocabulary(student: Any, teacher: Any) -> bool:
    """Whether every token id means the same text to both tokenizers (what scoring the student's ids needs)."""
    return student.get_vocab() == teacher.get_vocab()


class Distill:
    """Distillation's part of the loop: the teacher's reverse KL on the student's sampled tokens as advantages."""

    def __init__(self, cfg: DistillConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 teacher: torch.nn.Module):
        self.cfg, self.model, self.optimizer, self.teacher = cfg, model, optimizer, teacher
        self.ref = distributed.frozen_copy(model) if cfg.kl_coef > 0 else None
        self.refills = 0

    def keep(self, group: Group) -> bool:
        """Every group with a valid episode: each token is scored by the teacher, whatever the group's rewards."""
        return bool(group.valid)

    def train_step(self, kept: list[Group], collected: list[Group], step: int) -> dict:
        """One policy update on the teacher's per-token advantages (plus the reward's, weighted by `reward_coef`)."""
        cfg, metrics = self.cfg, reward_metrics(collected, self.cfg.reward)
        if not kept:
            return metrics
        rewards = [group_rewards(g, cfg.reward) for g in kept]
        present = [r for rs in rewards for r in rs if r is not None]
        batch = to_batch(kept, cfg.advantage, rewards)  # the reward's advantages; episodes without a reward left out
        teacher_BT = loop.model_logprobs(self.teacher, batch, cfg)
        adv_BT = distillation_advantages(batch.old_logp_BT, teacher_BT, batch.mask_BT) + cfg.reward_coef * batch.adv_BT
        metrics["train_reward"] = sum(present) / len(present)
        metrics["reverse_kl"] = masked_mean(batch.old_logp_BT - teacher_BT, batch.mask_BT).item()
        metrics.update(loop.update(self.model, self.ref, self.optimizer, replace(batch, adv_BT=adv_BT), cfg,
                                   torch.Generator().manual_seed(cfg.seed + step)))
        return metrics

    def checkpoint_state(self, sharding: Sharding) -> tuple[dict, dict]:
        """Nothing beyond the policy: the teacher is frozen and loads from its folder again on resume."""
        return {}, {}

    def restore(self, checkpoint: Path, state: dict) -> None:
        """Nothing to restore (see `checkpoint_state`)."""


def load_teacher(path: str, like: torch.nn.Module) -> torch.nn.Module:
    """The teacher, frozen and in eval mode, on the student's device, computing in the student's dtype."""
    parameter = next(like.parameters())
    teacher = AutoModelForCausalLM.from_pretrained(os.path.expanduser(path), dtype=parameter.dtype)
    return mixed_precision(teacher.to(parameter.device).eval().requires_grad_(False), compute_dtype(like))


def train(cfg: DistillConfig, model: torch.nn.Module, tokenizer: Any, policy: Policy,
          make_env: Callable[[], TextEnv], tasks: list[Task], out_dir: Path, on_step: Callable[[int, dict], None] | None = None,
          periodic_eval: Callable[[int, Callable], dict] | None = None, engines: Engines | None = None,
          sources: int = 0) -> list[dict]:
    """Runs (or resumes, from the latest checkpoint in `out_dir`) on-policy distillation of `cfg.teacher` into
    `model`, which `policy` samples from after each sync. Returns the metrics of the steps run now (`loop.run`)."""
    torch.manual_seed(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    method = Distill(cfg, model, optimizer, load_teacher(cfg.teacher, model))
    return loop.run(cfg, method, tokenizer, policy, engines or EnvEngines(make_env), tasks, out_dir,
                    loop.Hooks(on_step, periodic_eval, sources))


class DistillStage(RLStage):
    """`[distill]`: the RL loop with the teacher's per-token reverse KL as the advantage."""

    @staticmethod
    def preflight(job: TrainJob) -> None:
        teacher = job.distill.teacher
        try:
            teacher_tokenizer = load_tokenizer(teacher)
        except FileNotFoundError:
            raise ValueError(f"[distill] no teacher at {teacher!r} (no tokenizer there): train or fetch it first (for "
                             "recipes/cpu_smollm2_math_distill_train.toml: make demo-smollm2)") from None
        try:
            student_tokenizer = load_tokenizer(job.model)
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
        if not same_vocabulary(student_tokenizer, teacher_tokenizer):
            raise ValueError(f"[distill] teacher {teacher!r} has another tokenizer than the student {job.model!r}: "
                             "the teacher scores the student's token ids, which must mean the same text to both; "
                             "distill from a model of the student's family (the same vocabulary)")

    def train(self) -> dict[str, Any]:
        run_loop(self.setup, self.setup.job.distill, train, "on-policy distillation",
                 note=f" (teacher {self.setup.job.distill.teacher})")
        return {}
