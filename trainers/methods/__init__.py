"""The RL methods a recipe chooses from, one module each, and their table: a recipe's method is the one whose
table (`[ppo]`, `[tandem]`, ...) it has, else GRPO. Adding a method is a module with its config and its `RLStage`
(`trainers/methods/stage.py`), an entry here and its table in `TrainJob` (docs/methods.md, "A new method")."""

from __future__ import annotations

from dataclasses import dataclass

from agentrl.trainers.methods.distill import DistillStage
from agentrl.trainers.methods.dpo import DPOStage
from agentrl.trainers.methods.grpo import GRPOStage
from agentrl.trainers.methods.ppo import PPOStage
from agentrl.trainers.methods.stage import RLStage
from agentrl.trainers.methods.tandem import TandemStage
from agentrl.trainers.methods.tango import TangoStage


@dataclass(frozen=True)
class MethodSpec:
    """An RL method: what runs it, where its loop's settings are, and what it supports."""

    stage: type[RLStage]  # runs it: made after the warm starts, evaluated before and after its `train`
    settings: str  # the table of its settings: its own, or [grpo] for the methods built on GRPO
    loop: bool = True  # its settings are an RL loop's (`LoopConfig`: steps, rollout, reward, ...)
    shardable: bool = False  # runs sharded under torchrun (FSDP)
    asynchronous: bool = False  # runs with rollouts ahead of training (max_staleness > 0, [ray] sources)
    agents: bool = False  # trains agent programs through the gateway ([agent])
    critic: bool = False  # trains a critic beside the policy (what a dry run plans memory for)


METHODS: dict[str, MethodSpec] = {
    "grpo": MethodSpec(GRPOStage, "grpo", shardable=True, asynchronous=True, agents=True),
    "ppo": MethodSpec(PPOStage, "ppo", shardable=True, asynchronous=True, agents=True, critic=True),
    "tandem": MethodSpec(TandemStage, "grpo"),  # GRPO on tandem rollouts
    "tango": MethodSpec(TangoStage, "grpo"),  # GRPO with a co-trained process verifier
    "dpo": MethodSpec(DPOStage, "dpo", loop=False),  # DPO on pairs of the starting model's episodes
    "distill": MethodSpec(DistillStage, "distill"),  # on-policy distillation: a teacher scores the student's tokens
}
