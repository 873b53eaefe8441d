"""The typed configs of the CLI's jobs that are not training runs (`agentrl rollout`, `agentrl eval`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import with_config

from agentrl.config import STRICT
from agentrl.models.tokenizer import chat_template_text
from agentrl.policy.backends import EngineConfig
from agentrl.rollout.engine import RolloutConfig, evaluation_temperature
from agentrl.rollout.ray_pool import RayConfig


@with_config(STRICT)
@dataclass(frozen=True)
class RolloutJob:
    """`agentrl rollout`: which env and model, how many tasks, where the trajectories go."""

    env: str  # env id, e.g. "math/arith-v0"
    model: str  # model directory or hub name
    chat_template: str | None = None  # the model's own, or "chatml-tools" / a Jinja file (agentrl.models.tokenizer)
    n: int = 64  # tasks; each gives `rollout.group_size` episodes
    split: str = "train"
    out: str = "runs/rollout.jsonl"
    env_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to agentrl.make
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)  # transformers in-process, or vLLM
    ray: RayConfig | None = None  # envs in Ray worker actors (a local cluster, or `address`'s)

    def __post_init__(self) -> None:
        if self.chat_template is not None:
            chat_template_text(self.chat_template)  # a name or file that does not exist fails here, not mid-run
        if self.ray and self.ray.sources:
            raise ValueError("ray.sources places asynchronous training's rollout sources (agentrl train); agentrl "
                             "rollout plays its episodes from this process: remove it")


@with_config(STRICT)
@dataclass(frozen=True)
class EvalJob:
    """`agentrl eval`: which suite and model, how many samples per task, where the run directory is."""

    suite: str  # a registered suite (`agentrl suites`) or a suite TOML file
    model: str  # model directory or hub name (or, with engine.url, the model the server serves)
    k: list[int] = field(default_factory=lambda: [1])  # pass@k for these k; each task is sampled max(k) times
    n: int | None = None  # at most this many tasks per suite entry (None: all)
    out: str | None = None  # the run directory [default: runs/eval/SUITE]; the same job run again resumes it
    tokenizer: str | None = None  # tokenizer directory or hub name [default: the model's]
    chat_template: str | None = None  # the model's own, or "chatml-tools" / a Jinja file (agentrl.models.tokenizer)
    engine: EngineConfig = field(default_factory=EngineConfig)  # transformers in-process, or vLLM
    # greedy unless set: sample i of a task gets its own seed, so pass@k with k > 1 needs a temperature
    temperature: float = 0.0
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # its sampling is at `temperature`

    @staticmethod
    def derive(recipe: dict[str, Any]) -> dict[str, Any]:
        """The recipe as it is, once its rollout is checked not to set a temperature of its own."""
        evaluation_temperature(recipe, "")
        return recipe

    def __post_init__(self) -> None:
        if self.chat_template is not None:
            chat_template_text(self.chat_template)
        if not self.k or min(self.k) < 1:
            raise ValueError(f"k takes positive integers, e.g. [1, 8]; got {self.k}")
        if max(self.k) > 1 and self.temperature == 0:
            raise ValueError(f"pass@{max(self.k)} over greedy samples would count one answer {max(self.k)} times: set "
                             "temperature (e.g. 1.0; `--temperature`)")
        if self.rollout.group_size != 1:
            raise ValueError("rollout.group_size: the eval samples each task max(k) times itself; set k instead")
        object.__setattr__(self, "rollout", self.rollout.at_temperature(self.temperature))
