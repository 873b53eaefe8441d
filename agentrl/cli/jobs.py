"""The typed configs of the CLI's jobs that are not training runs (`agentrl rollout`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import with_config

from agentrl.config import STRICT
from agentrl.policy.backends import EngineConfig
from agentrl.rollout.engine import RolloutConfig
from agentrl.rollout.ray_pool import RayConfig


@with_config(STRICT)
@dataclass(frozen=True)
class RolloutJob:
    """`agentrl rollout`: which env and model, how many tasks, where the trajectories go."""

    env: str  # env id, e.g. "math/arith-v0"
    model: str  # model directory or hub name
    n: int = 64  # tasks; each gives `rollout.group_size` episodes
    split: str = "train"
    out: str = "runs/rollout.jsonl"
    env_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to agentrl.make
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)  # transformers in-process, or vLLM
    ray: RayConfig | None = None  # envs in Ray worker actors (a local cluster, or `address`'s)
