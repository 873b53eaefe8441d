"""A training job as a recipe states it: `TrainJob`, one typed config with a table per stage (warm starts, the RL
method's, the held-out evaluation, the engine). Checked as a whole when it loads: settings that cannot work
together are a `ValueError` that says the fix, before any work."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import with_config

from agentrl.config import STRICT, merge
from agentrl.gateway.agents import AgentConfig
from agentrl.models.tokenizer import chat_template_text
from agentrl.policy.backends import EngineConfig
from agentrl.rollout.engine import RolloutConfig, evaluation_temperature
from agentrl.rollout.ray_pool import RayConfig
from agentrl.rollout.ray_source import source_problems
from agentrl.trainers.losses import ADVANTAGE_WEIGHTED
from agentrl.trainers.lora import LoraSettings
from agentrl.trainers.methods import METHODS
from agentrl.trainers.methods.distill import DistillConfig
from agentrl.trainers.methods.dpo import DPOConfig
from agentrl.trainers.methods.grpo import GRPOConfig
from agentrl.trainers.methods.ppo import PPOConfig
from agentrl.trainers.methods.tandem import TandemConfig
from agentrl.trainers.methods.tango import TangoConfig
from agentrl.trainers.pretrain import CopyWarmup
from agentrl.trainers.sft import SFTConfig


@with_config(STRICT)
@dataclass(frozen=True)
class DemoSFT:
    """Warm start: imitate the env's expert demonstrations (`TextEnv.demonstration`)."""

    episodes: int = 256  # demonstration episodes, on the training split
    error_rate: float = 0.0  # the expert's deliberate mistake rate
    env_kwargs: dict[str, Any] = field(default_factory=dict)  # overrides of the job's, e.g. {train_worlds = 64}
    config: SFTConfig = field(default_factory=SFTConfig)


@with_config(STRICT)
@dataclass(frozen=True)
class EvalConfig:
    split: str | list[str] = "heldout"  # one split, or several held-out suites (each reported, then averaged)
    n: int = 200  # tasks per split, one episode each
    every: int = 0  # also evaluate every this many RL steps, logged with the training metrics (0: never)
    temperature: float = 0.0  # the episodes' sampling temperature (greedy); `rollout.sampling` is given it
    # in a recipe: the RL rollout's table (`TrainJob.derive`: budgets, parser limits and timeouts set once) and the
    # keys this table sets; one episode per task
    rollout: RolloutConfig = field(default_factory=RolloutConfig)

    def __post_init__(self) -> None:
        if self.rollout.group_size != 1:
            raise ValueError("eval.rollout.group_size: a held-out evaluation plays one episode per task; remove it")
        object.__setattr__(self, "rollout", self.rollout.at_temperature(self.temperature))


def engine_correction(loss: str) -> dict[str, Any]:
    """The default `correction` of an RL loop sampled by vLLM: its kernels (and dtype) are not the trainer's, so its
    logprobs differ a little from the trainer's on the same weights. The trainer recomputes PPO's old logprobs
    (decoupled) and weighs each token by its truncated importance weight (TIS; for the losses that read the
    advantage itself, MIS masks the tokens off by more than its threshold instead). In process, the sampler is the
    trainer's own model: no correction."""
    return {"decoupled": True, "tis" if loss in ADVANTAGE_WEIGHTED else "mis": "token"}


@with_config(STRICT)
@dataclass(frozen=True)
class TrainJob:
    env: str  # env id
    model: str  # model directory or hub name
    chat_template: str | None = None  # the model's own, or "chatml-tools" / a Jinja file (agentrl.models.tokenizer)
    device: str = "cpu"  # where the trainer and the in-process sampler run, e.g. "cuda"
    dtype: str = "float32"  # the trainer's (and in-process sampler's) compute dtype; "bfloat16": autocast forwards
    master_weights: bool = True  # with bfloat16: float32 parameters and AdamW states (false: bf16, lr 1e-6 rounds away)
    # train LoRA adapters instead of all weights (a vLLM engine is sent the adapter alone: `engine.lora_rank`)
    lora: LoraSettings | None = None
    gradient_checkpointing: bool = False  # recompute activations in the backward pass: less memory, more time
    out_dir: str = "runs/train"
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    train_tasks: int | None = None  # cap on training-split tasks (None: all)
    warmup: CopyWarmup | None = None  # before SFT: teach a randomly initialized model to copy (trainers/pretrain.py)
    sft: DemoSFT | list[DemoSFT] | None = None  # one SFT stage ([sft]), or several in order ([[sft]])
    eval: EvalConfig | None = field(default_factory=EvalConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    ppo: PPOConfig | None = None  # instead of GRPO: PPO with a critic and GAE
    tandem: TandemConfig | None = None  # GRPO on tandem rollouts: a frozen junior writes some of each response
    tango: TangoConfig | None = None  # GRPO with a co-trained process verifier (RL Tango)
    dpo: DPOConfig | None = None  # instead of GRPO: DPO on pairs of the starting model's episodes
    distill: DistillConfig | None = None  # instead of GRPO: on-policy distillation from a teacher model
    engine: EngineConfig = field(default_factory=EngineConfig)  # transformers in-process, or vLLM
    ray: RayConfig | None = None  # envs in Ray worker actors (a local cluster, or `address`'s)
    # train an agent program through the gateway instead of the env's episodes; the env gives the tasks
    agent: AgentConfig | None = None

    def __post_init__(self) -> None:
        if self.chat_template is not None:
            chat_template_text(self.chat_template)  # a name or file that does not exist fails here, not mid-run
        if self.dtype == "float16":
            raise ValueError("dtype float16 needs loss scaling (a GradScaler), which the trainer does not do: use "
                             "bfloat16 (the same memory, float32's range)")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if not self.master_weights and self.dtype == "float32":
            raise ValueError("master_weights = false keeps the parameters in dtype; with dtype float32 there is no "
                             "other copy to drop: remove master_weights, or set dtype = 'bfloat16'")
        chosen = [name for name in METHODS if name != "grpo" and getattr(self, name) is not None]
        if len(chosen) > 1:
            raise ValueError(f"choose one RL method per recipe, got sections {chosen}")
        spec = METHODS[self.method]
        if spec.settings != "grpo" and self.grpo != GRPOConfig():
            raise ValueError(f"[{self.method}] replaces GRPO: move its settings into [{self.method}] and remove [grpo]")
        spec.stage.check(self)
        if self.agent is not None and (not spec.agents or self.ray is not None):
            raise ValueError(f"[agent] programs train with GRPO or PPO, their sessions in this process: remove "
                             f"{'[ray]' if self.ray is not None else f'[{self.method}]'}")
        engine = self.engine
        if engine.lora_rank is not None and (self.lora is None or engine.lora_rank < self.lora.r):
            got = "no [lora]" if self.lora is None else f"lora.r = {self.lora.r}"
            raise ValueError(f"engine.lora_rank = {engine.lora_rank} serves LoRA adapters up to that rank, which a "
                             f"job sends with a [lora] whose r is at most it (got {got}): remove engine.lora_rank, "
                             "or set it to the job's r")
        if engine.lora_rank is not None and (engine.max_loras or 2) < self.rl.max_staleness + 1:
            raise ValueError(f"engine.max_loras = {engine.max_loras} adapters cannot hold the max_staleness + 1 = "
                             f"{self.rl.max_staleness + 1} versions that rollouts in flight may sample with: raise it")
        if self.rl.max_staleness or (self.ray and self.ray.sources):
            self._check_asynchronous()
        if engine.kind == "vllm" and not engine.url and engine.max_model_len < self.context:
            raise ValueError(f"engine.max_model_len ({engine.max_model_len}) is below the rollouts' longest "
                             f"trajectory ({self.context} tokens: max_total_tokens, or a context.window): episodes "
                             "would fail at the server's context; raise it")
        if (engine.kind == "vllm" and engine.device == "gpu" and not engine.url and engine.gpus is None
                and engine.gpu_memory_utilization is None and self.device.startswith("cuda")):
            raise ValueError("the vLLM server would share the trainer's GPU and take 90% of its memory: set "
                             "engine.gpu_memory_utilization (e.g. 0.3 for a 0.5 B model beside its trainer), or give "
                             "the server GPUs of its own with engine.gpus (e.g. \"1\")")

    @staticmethod
    def derive(recipe: dict[str, Any]) -> dict[str, Any]:
        """The recipe with its `[eval.rollout]` started from the RL rollout's table (its method's `rollout`) less the
        sampling temperature (evaluation is greedy unless `eval.temperature` says otherwise): budgets, parser limits
        and timeouts are set once, and the table keeps what it sets itself. With a vLLM engine, an RL loop whose
        recipe has no `correction` table gets the engine's (`engine_correction`), and a LoRA job's server serves
        adapters of its rank (`engine.lora_rank`, `engine.max_loras`: max_staleness + 1)."""
        method = next((name for name in METHODS if name != "grpo" and name in recipe), "grpo")
        settings = METHODS[method].settings
        table = lambda data, key: data.get(key) if isinstance(data, dict) else None  # noqa: E731 (else: invalid)
        loop = recipe.get(settings, {})
        if (METHODS[method].loop and isinstance(loop, dict) and "correction" not in loop
                and table(recipe.get("engine"), "kind") == "vllm"):
            recipe = merge(recipe, {settings: {"correction": engine_correction(loop.get("loss", "ppo"))}})
        engine, lora = recipe.get("engine"), recipe.get("lora")
        if (isinstance(lora, dict) and table(engine, "kind") == "vllm" and not table(engine, "url")
                and table(engine, "lora_rank") is None and isinstance(loop, dict)):
            # the server it starts serves the adapter, and keeps one version per weight version in flight
            recipe = merge(recipe, {"engine": {"lora_rank": lora.get("r", LoraSettings.r),
                                               "max_loras": loop.get("max_staleness", 0) + 1}})
        rl, evaluation = table(table(recipe, settings), "rollout"), table(recipe, "eval")
        evaluation_temperature(evaluation, "eval.")
        if not isinstance(rl, dict) or (evaluation is None and "eval" in recipe):
            return recipe  # nothing to start from, or a malformed table that validation names
        rl = json.loads(json.dumps(rl))  # a copy
        if isinstance(rl.get("sampling"), dict):
            rl["sampling"].pop("temperature", None)
        own = evaluation.get("rollout", {}) if evaluation else {}
        return merge(recipe, {"eval": {"rollout": merge(rl, own) if isinstance(own, dict) else own}})

    def _check_asynchronous(self) -> None:
        """What asynchronous training (`max_staleness > 0`) does not run with yet: a clear error, before any work."""
        section, problems = METHODS[self.method].settings, []
        if not METHODS[self.method].asynchronous:
            problems.append(f"[{self.method}] runs synchronously: remove max_staleness")
        if self.engine.sleep_mode:
            problems.append("engine.sleep_mode frees the engine's memory while the trainer steps, but asynchronous "
                            "rollouts sample then: remove sleep_mode")
        if self.ray and self.ray.sources and self.lora and self.engine.kind == "vllm":
            problems.append("a LoRA job's syncs switch the engine to each new adapter, which rollout sources in Ray "
                            "actors do not follow yet: remove ray.sources (rollouts run in a thread of this process)")
        if self.ray and self.ray.sources:
            problems += source_problems(self.ray.sources, self.rl.max_staleness, self.rl.tasks_per_step,
                                        self.engine.kind == "vllm", section)
        if problems:
            raise ValueError(f"{section}.max_staleness = {self.rl.max_staleness}: " + "; ".join(problems))

    @property
    def sft_stages(self) -> list[DemoSFT]:
        """The SFT stages in the order they run: none, the one `[sft]`, or every `[[sft]]`."""
        return self.sft if isinstance(self.sft, list) else [self.sft] if self.sft else []

    @property
    def method(self) -> str:
        """The RL method: the one of `METHODS` whose table the recipe has, else GRPO."""
        return next((name for name in METHODS if name != "grpo" and getattr(self, name) is not None), "grpo")

    @property
    def context(self) -> int:
        """The longest trajectory, prompt included, of any rollout of the job (an episode, or a segment's window):
        what the engine's context must hold."""
        rollouts = [self.rl.rollout, self.settings.rollout] + ([self.eval.rollout] if self.eval else [])
        return max(r.window for r in rollouts)

    @property
    def settings(self) -> GRPOConfig | PPOConfig | DistillConfig | DPOConfig:
        """The method's settings: its table, or [grpo] for the methods built on GRPO."""
        return getattr(self, METHODS[self.method].settings)

    @property
    def rl(self) -> GRPOConfig | PPOConfig | DistillConfig:
        """The RL loop's settings: the method's, or [grpo]'s for a method without a loop (DPO), whose rollout and
        seed the warm starts use."""
        return self.settings if METHODS[self.method].loop else self.grpo
