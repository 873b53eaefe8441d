"""`agentrl train RECIPE.toml`: optional SFT warm start on expert demonstrations → held-out evaluation →
RL → held-out evaluation, with a reward-curve plot and a summary. Resumable: a run killed during GRPO or PPO
continues from its latest checkpoint; finished stages are not redone.

The RL stage is GRPO, or PPO with a critic (`[ppo]`), or one of the research methods, chosen by which
section the recipe has: `[tandem]` (GRPO on senior/junior tandem rollouts, plus handoff-robustness
evaluation), `[tango]` (GRPO with a co-trained process verifier) or `[dpo]` (offline DPO on pairs of the
starting model's episodes). `[grpo.reward]` picks the reward sources (majority vote, format-only, ...).
`[lora]` trains LoRA adapters instead of all weights, in every stage.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Callable

import torch
from pydantic import with_config
from transformers import AutoModelForCausalLM

from agentrl.config import STRICT, merge, table_defaults
from agentrl.policy.backends import EngineConfig, open_policy
from agentrl.eval.report import plot_reward_curve, plot_timeline
from agentrl.eval.run import run_suite
from agentrl.env.suites import Suite, SuiteEntry
from agentrl.gateway.agents import AgentConfig, AgentEngines
from agentrl.policy.hf import HFPolicy
from agentrl.policy.precision import mixed_precision
from agentrl.policy.protocol import Policy, SamplingParams
from agentrl.rollout.ray_pool import RayConfig, env_factory
from agentrl.rollout.ray_source import source_problems
from agentrl.env.registry import make
from agentrl.renderer import Renderer
from agentrl.rollout.engine import RolloutConfig, RolloutEngine
from agentrl.rollout.jsonl import JsonlWriter, read_records
from agentrl.policy.scripted import ScriptedPolicy, playing
from agentrl.models.tokenizer import chat_template_text, load_tokenizer
from agentrl.trainers import distributed
from agentrl.trainers.methods import tango
from agentrl.trainers.checkpoint import latest_checkpoint, load_model, save_checkpoint, save_model, write_folder
from agentrl.trainers.methods.dpo import DPOConfig, preference_pairs, train_dpo
from agentrl.trainers.methods.grpo import GRPOConfig, train as train_grpo
from agentrl.trainers.job.heldout import heldout
from agentrl.trainers.lora import LoraSettings, add_lora
from agentrl.trainers.methods.ppo import PPOConfig, train as train_ppo
from agentrl.trainers.pretrain import CopyWarmup, alphabet, copy_in_context, copy_warmup, vocabulary
from agentrl.trainers.job.progress import mean_of_last, progress_line, stage_progress, tango_line
from agentrl.trainers.rewards.judge import close_judges, judge_for
from agentrl.trainers.rewards import RewardConfig
from agentrl.trainers.sft import SFTConfig, sft
from agentrl.trainers.methods.tandem import TandemConfig, TandemPolicy, junior_cross_entropy
from agentrl.trainers.methods.tango import TangoConfig


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
    every: int = 0  # also evaluate every this many GRPO steps, logged with the training metrics (0: never)
    # in a recipe: the RL rollout's table less its group_size and temperature (`TrainJob.derive`), greedy, and the
    # keys this table sets
    rollout: Annotated[RolloutConfig, table_defaults(sampling={"temperature": 0.0})] = field(
        default_factory=lambda: RolloutConfig(sampling=SamplingParams(temperature=0.0)))


@dataclass(frozen=True)
class Method:
    """An RL method that a recipe chooses by its table: where its loop's settings are, and what it supports."""

    settings: str  # the table of its loop's settings: its own, or [grpo] for the methods built on GRPO
    shardable: bool = False  # runs sharded under torchrun (FSDP)


METHODS: dict[str, Method] = {  # a recipe with none of these tables runs GRPO
    "grpo": Method("grpo", shardable=True),
    "ppo": Method("ppo", shardable=True),  # PPO with a critic and GAE, instead of GRPO
    "tandem": Method("grpo"),  # GRPO on tandem rollouts
    "tango": Method("grpo"),  # GRPO with a co-trained process verifier
    "dpo": Method("dpo"),  # DPO on pairs of the starting model's episodes, instead of GRPO
}


@with_config(STRICT)
@dataclass(frozen=True)
class TrainJob:
    env: str  # env id
    model: str  # model directory or hub name
    chat_template: str | None = None  # the model's own, or "chatml-tools" / a Jinja file (agentrl.models.tokenizer)
    device: str = "cpu"  # where the trainer and the in-process sampler run, e.g. "cuda"
    dtype: str = "float32"  # the trainer's (and in-process sampler's) compute dtype; "bfloat16": autocast forwards
    master_weights: bool = True  # with bfloat16: float32 parameters and AdamW states (false: bf16, lr 1e-6 rounds away)
    lora: LoraSettings | None = None  # train LoRA adapters instead of all weights (engines get them merged)
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
        if chosen and METHODS[chosen[0]].settings != "grpo" and self.grpo != GRPOConfig():
            raise ValueError(f"[{chosen[0]}] replaces GRPO: move its settings into [{chosen[0]}] and remove [grpo]")
        if self.tandem is not None and self.engine.url:
            raise ValueError("[tandem] starts a second vLLM server for the junior; it cannot attach to engine.url: "
                             "remove engine.url to let the job start both servers")
        if self.tango is not None and self.engine.kind != "transformers":
            raise ValueError("[tango] trains the verifier in-process: set engine.kind = 'transformers'")
        if self.agent is not None and (self.method not in ("grpo", "ppo") or self.ray is not None):
            raise ValueError(f"[agent] programs train with GRPO or PPO, their sessions in this process: remove "
                             f"{'[ray]' if self.ray is not None else f'[{self.method}]'}")
        engine = self.engine
        if self.rl.max_staleness or (self.ray and self.ray.sources):
            self._check_asynchronous()
        if engine.kind == "vllm" and not engine.url and engine.max_model_len < self.context:
            raise ValueError(f"engine.max_model_len ({engine.max_model_len}) is below the rollouts' max_total_tokens "
                             f"({self.context}): episodes would fail at the server's context; raise it")
        if (engine.kind == "vllm" and engine.device == "gpu" and not engine.url and engine.gpus is None
                and engine.gpu_memory_utilization is None and self.device.startswith("cuda")):
            raise ValueError("the vLLM server would share the trainer's GPU and take 90% of its memory: set "
                             "engine.gpu_memory_utilization (e.g. 0.3 for a 0.5 B model beside its trainer), or give "
                             "the server GPUs of its own with engine.gpus (e.g. \"1\")")

    @staticmethod
    def derive(recipe: dict[str, Any]) -> dict[str, Any]:
        """The recipe with its `[eval.rollout]` started from the RL rollout's table (`[grpo|ppo|dpo].rollout`) less
        `group_size` and the sampling temperature (evaluation is one greedy episode per task unless it says
        otherwise): budgets, parser limits and timeouts are set once, and the table keeps what it sets itself."""
        settings = next((METHODS[name].settings for name in ("ppo", "dpo") if name in recipe), "grpo")
        table = lambda data, key: data.get(key) if isinstance(data, dict) else None  # noqa: E731 (else: invalid)
        rl, evaluation = table(table(recipe, settings), "rollout"), table(recipe, "eval")
        if not isinstance(rl, dict) or (evaluation is None and "eval" in recipe):
            return recipe  # nothing to start from, or a malformed table that validation names
        rl = json.loads(json.dumps({k: v for k, v in rl.items() if k != "group_size"}))  # a copy
        if isinstance(rl.get("sampling"), dict):
            rl["sampling"].pop("temperature", None)
        own = evaluation.get("rollout", {}) if evaluation else {}
        return merge(recipe, {"eval": {"rollout": merge(rl, own) if isinstance(own, dict) else own}})

    def _check_asynchronous(self) -> None:
        """What asynchronous training (`max_staleness > 0`) does not run with yet: a clear error, before any work."""
        section, problems = "ppo" if self.ppo else "grpo", []
        if self.method not in ("grpo", "ppo"):
            problems.append(f"[{self.method}] runs synchronously: remove max_staleness")
        if self.engine.sleep_mode:
            problems.append("engine.sleep_mode frees the engine's memory while the trainer steps, but asynchronous "
                            "rollouts sample then: remove sleep_mode")
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
        """The longest episode, prompt included, of any rollout of the job: what the engine's context must hold."""
        rollouts = [self.rl.rollout] + ([self.eval.rollout] if self.eval else []) + \
                   ([self.dpo.rollout] if self.dpo else [])
        return max(r.max_total_tokens for r in rollouts)

    @property
    def rl(self) -> GRPOConfig | PPOConfig:
        """The RL loop's settings: [ppo] when the recipe has it, else [grpo] (also read by the methods)."""
        return self.ppo or self.grpo


def run(job: TrainJob, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole job; resumable. Under torchrun (several processes), the GRPO trainer is sharded with FSDP2
    over the ranks and rank 0 samples, evaluates and writes (`trainers/distributed.py`, docs/scaling.md)."""
    rank, world = distributed.init() if distributed.launched() else (0, 1)
    if world > 1:
        check_shardable(job)
        log = log if rank == 0 else (lambda message: None)
    out = Path(os.path.expanduser(job.out_dir))
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    tokenizer = load_tokenizer(job.model, job.chat_template)
    renderer = Renderer(tokenizer)
    env = make(job.env, **job.env_kwargs)
    make_env = env_factory(job.env, job.env_kwargs, job.ray)
    tasks = list(env.tasks)[:job.train_tasks]
    # fp32 master weights whose forwards compute in dtype under autocast (agentrl/policy/precision.py), unless
    # master_weights = false keeps the parameters in dtype itself
    compute, in_process = getattr(torch, job.dtype), job.engine.kind == "transformers"
    param_dtype = torch.float32 if job.master_weights else compute
    autocast_dtype = compute if compute != param_dtype else None
    policy = None  # rank 0 samples: in-process, or vLLM with every sync parity-checked on two task prompts
    if rank == 0 and in_process:
        policy = HFPolicy.load(job.model, device=job.device, dtype=param_dtype)
        mixed_precision(policy.model, autocast_dtype)  # samples with the trainer's numerics (it may share the model)
    elif rank == 0:
        prompts = [renderer.prompt_ids(env.first_messages(t), env.tool_schemas) for t in tasks[:2]]
        policy = open_policy(job.model, job.engine, parity_prompts=prompts)
    if in_process and world == 1 and not job.rl.max_staleness:  # the sampler shares the trainer's model: free syncs
        model = policy.model
    elif world > 1:  # the trainer sharded over the ranks under torchrun
        model = distributed.from_pretrained(os.path.expanduser(job.model), param_dtype, autocast_dtype, job.device)
    else:  # the trainer has its own copy (asynchronous: the sampler runs on)
        model = AutoModelForCausalLM.from_pretrained(os.path.expanduser(job.model), dtype=param_dtype).to(job.device)
        mixed_precision(model, autocast_dtype)
    if job.lora:  # in place: the in-process sampler holds this very model
        add_lora(model, job.lora)
    if job.gradient_checkpointing:  # non-reentrant: works when the embeddings are frozen (LoRA)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    if (prepare := getattr(policy, "prepare_sync", None)) is not None:  # vLLM: a sync that cannot work fails now,
        asyncio.run(prepare(model, job.context))                          # not after the baseline evaluation
    if job.rl.reward.judge is not None:  # so does a judge that cannot judge (loaded or reached once, here)
        judge_for(job.rl.reward.judge)
    save = lambda: summary_path.write_text(json.dumps(summary, indent=2))  # noqa: E731
    warm_start(job, model, tokenizer, policy, renderer, make_env, tasks, summary, save, log)
    handoff = Handoff(job, policy, tokenizer, model) if job.tandem else None

    engines = AgentEngines(job.agent) if job.agent else None  # else the env's episodes

    def evaluate_now(label: str) -> dict[str, Any]:
        metrics, trajectories = heldout(job, policy, renderer, make_env, log, label, engines)
        return {**metrics, "handoff": handoff.evaluate(trajectories, renderer, label, log)} if handoff else metrics

    if job.eval and "before" not in summary and rank == 0:
        summary["before"] = evaluate_now("before RL")
        save()

    summary["method"] = job.method
    if not job.dpo and job.rl.reward != RewardConfig():
        summary["method"] += f" ({job.rl.reward.describe()})"
    started = time.perf_counter()
    if not (job.dpo or job.tango or job.rl.steps):
        log("No RL stage (steps = 0).")
    elif job.dpo and (checkpoint := latest_checkpoint(out)) is not None:  # DPO finished in an earlier run
        _load_stage(model, policy, checkpoint, log, version=1)
    elif job.dpo:
        summary["dpo"] = run_dpo(job, model, tokenizer, policy, renderer, make_env, tasks, out, log)
    elif job.tango:
        run_tango(job, model, tokenizer, policy, renderer, make_env, tasks, out, log)
    else:
        algo, cfg, loop = ("PPO", job.ppo, train_ppo) if job.ppo else ("GRPO", job.grpo, train_grpo)
        log(f"{algo}: {cfg.steps} steps × {cfg.tasks_per_step} tasks × {cfg.rollout.group_size}"
            + (f" (tandem: junior writes each {job.tandem.unit} with p={job.tandem.p_junior})" if handoff else ""))

        def periodic_eval(step: int, execute: Callable) -> dict[str, Any]:
            due = job.eval and job.eval.every and step % job.eval.every == 0 and step < cfg.steps
            return heldout(job, policy, renderer, make_env, log, f"at step {step}", engines, execute)[0] if due else {}

        loop(cfg, model, tokenizer, handoff.training_policy() if handoff else policy, make_env, tasks, out,
             on_step=lambda step, m: log(progress_line(step, cfg.steps, m)), periodic_eval=periodic_eval,
             engines=engines, sources=job.ray.sources if job.ray else 0)
    if rank > 0:  # rank 0 evaluates and writes
        return summary
    summary["rl_seconds"] = round(time.perf_counter() - started, 1)
    if job.eval and (job.dpo or job.tango or job.rl.steps):
        summary["after"] = evaluate_now("after RL")
    save()
    if (out / "metrics.jsonl").exists():
        rows = read_records(out / "metrics.jsonl")
        (out / "reward_curve.png").write_bytes(plot_reward_curve(rows))
        if any("timeline" in row for row in rows):  # runs from before the timeline have none
            (out / "timeline.png").write_bytes(plot_timeline(rows))
    asyncio.run(policy.close())
    close_judges()
    if handoff:
        asyncio.run(handoff.junior.close())
    return summary


def check_shardable(job: TrainJob) -> None:
    """What a sharded (torchrun) job supports so far; the rest is a clear error, not a silent single process."""
    unsupported = [name for name in ("warmup", "sft", "lora") if getattr(job, name)]
    unsupported += [] if METHODS[job.method].shardable else [job.method]
    unsupported += ["max_staleness"] if job.rl.max_staleness else []
    if unsupported:
        raise ValueError(f"a sharded (torchrun) job runs the GRPO or PPO loop only; remove {unsupported}. Run warm "
                         "starts in one process first and set model to their output (e.g. runs/X/sft_model).")
    if job.engine.kind == "vllm" and job.engine.transfer == "ipc":
        raise ValueError("weight_transfer 'ipc' hands the engine one GPU's memory, and a sharded trainer's weights "
                         "are spread over the ranks' GPUs: use 'nccl' (an engine on GPUs of its own) or 'gloo'")


def warm_start(job: TrainJob, model, tokenizer, policy, renderer, make_env, tasks, summary: dict,
               save: Callable[[], None], log: Callable[[str], None]) -> None:
    """Copy warm-up, then SFT on expert demonstrations, each if the recipe asks. A stage that finished in an
    earlier run is loaded from its saved model, not redone."""
    out, env = Path(os.path.expanduser(job.out_dir)), make_env()
    if job.warmup and "warmup" in summary and "sft" not in summary:
        _load_stage(model, policy, out / "warmup_model", log)
    elif job.warmup and "sft" not in summary:
        tokens = alphabet([a for t in tasks[:256] for a in env.gold_actions(t)], tokenizer)
        log(f"copy warm-up: {job.warmup.steps} steps on repeated sequences of the {len(tokens)} tokens the expert "
            "writes")
        history = copy_warmup(model, tokens, job.warmup, on_step=stage_progress(job.warmup.steps, log, "copy warm-up",
                                                                           "copy_accuracy"))
        summary["warmup"] = {"steps": len(history), "copy_accuracy": mean_of_last(history, "copy_accuracy")}
        if job.warmup.context_steps:  # the env's text: expert episodes on training tasks, played through the env
            episodes = demonstrations(make_env, tasks[:job.warmup.context_episodes], renderer, job.rl.rollout, 0.0,
                                      job.rl.seed, out / "warmup_text.jsonl")
            texts = [t.token_ids for t in episodes]
            log(f"copy in context: {job.warmup.context_steps} steps on {job.warmup.context_len}-token sequences of "
                f"the text of {len(texts)} expert episodes, random spans and repeats")
            history = copy_in_context(model, tokens, texts, job.warmup, on_step=stage_progress(
                job.warmup.context_steps, log, "copy in context", "copy_accuracy"))
            summary["warmup"]["context_copy_accuracy"] = mean_of_last(history, "copy_accuracy")
            if job.warmup.context_vocab_steps:  # then spans of every token: held-out names copy too
                vocab = vocabulary(tokenizer)
                cfg = replace(job.warmup, context_steps=job.warmup.context_vocab_steps, seed=job.warmup.seed + 1)
                log(f"copy in context, spans of all {len(vocab)} tokens: {cfg.context_steps} steps")
                history = copy_in_context(model, vocab, texts, cfg, on_step=stage_progress(
                    cfg.context_steps, log, "copy in context (vocabulary)", "copy_accuracy"))
                summary["warmup"]["vocab_copy_accuracy"] = mean_of_last(history, "copy_accuracy")
        asyncio.run(policy.sync_weights(model, 0))
        _save_stage(model, tokenizer, out / "warmup_model")
        save()
    stages = job.sft_stages
    done = len(stages) if "sft" in summary else len(summary.get("sft_stages", []))  # stages finished earlier
    if stages and done:  # continue from (RL, and tandem's junior, start from) the latest finished stage
        _load_stage(model, policy, out / "sft_model", log)
    for i in range(done, len(stages)):
        stage, label = stages[i], "SFT" if len(stages) == 1 else f"SFT {i + 1}/{len(stages)}"
        log(f"{label}: {stage.episodes} expert episodes (mistake rate {stage.error_rate}"
            + (", last turn only" if stage.config.last_turn_only else "")
            + (f"; env {stage.env_kwargs})" if stage.env_kwargs else ")"))
        stage_env, pool = make_env, tasks
        if stage.env_kwargs:  # e.g. more worlds: the stage's own envs and training tasks
            stage_env = env_factory(job.env, {**job.env_kwargs, **stage.env_kwargs}, job.ray)
            pool = list(stage_env().tasks)
        picked = [pool[k % len(pool)] for k in range(stage.episodes)]
        demos = demonstrations(stage_env, picked, renderer, job.rl.rollout, stage.error_rate, job.rl.seed,
                               out / ("sft_demos.jsonl" if len(stages) == 1 else f"sft{i + 1}_demos.jsonl"))
        steps = stage.config.epochs * -(-len(demos) // stage.config.batch_size)
        history = sft(model, demos, stage.config, on_step=stage_progress(steps, log, label, "loss"))
        asyncio.run(policy.sync_weights(model, 0))
        _save_stage(model, tokenizer, out / "sft_model")  # the warm-started model: other recipes can start from it
        result = {"steps": len(history), "final_loss": history[-1]["loss"], "kept": history[-1]["kept"]}
        summary["sft_stages"] = [*summary.get("sft_stages", []), result]
        if i == len(stages) - 1:
            summary["sft"] = result  # the last stage's: SFT is done
        save()


class Handoff:
    """Tandem's partner and its evaluation: the frozen junior (a policy, and an in-process copy for its
    cross-entropy), the training policy, and handoff robustness on the held-out split."""

    def __init__(self, job: TrainJob, senior: Policy, tokenizer: Any, model: torch.nn.Module):
        self.cfg, self.senior, self.tokenizer, self.job = job.tandem, senior, tokenizer, job
        if job.tandem.junior is None:  # the senior's weights as RL starts (after any SFT), frozen
            self.junior_model = copy.deepcopy(model).eval().requires_grad_(False)
            if job.engine.kind == "transformers":
                self.junior = HFPolicy(self.junior_model, tokenizer)
            else:
                junior_dir = Path(os.path.expanduser(job.out_dir)) / "junior"
                save_model(self.junior_model, tokenizer, junior_dir)
                self.junior = open_policy(str(junior_dir), job.engine)
        else:
            self.junior = open_policy(job.tandem.junior, job.engine)
            self.junior_model = AutoModelForCausalLM.from_pretrained(os.path.expanduser(job.tandem.junior)).eval()

    def policy(self, **schedule: Any) -> TandemPolicy:
        """A `TandemPolicy` of the senior and the junior with this `schedule` (`p_junior`, `junior_after`)."""
        return TandemPolicy(self.senior, self.junior, self.tokenizer, self.cfg.unit,
                            lookahead=self.cfg.lookahead, **schedule)

    def training_policy(self) -> TandemPolicy:
        """The tandem policy that RL samples from: the junior writes each unit with probability `tandem.p_junior`."""
        return self.policy(p_junior=self.cfg.p_junior)

    def evaluate(self, solo: list, renderer: Renderer, label: str, log: Callable[[str], None]) -> dict[str, Any]:
        """Success with the junior writing each unit with probability p / taking over after k units, and the
        junior's cross-entropy on the senior's solo held-out tokens; each schedule's episodes in
        OUT/heldout/LABEL/handoff/SCHEDULE."""
        out: dict[str, Any] = {"junior_xent": junior_cross_entropy(self.junior_model, solo)}
        schedules = [(f"p={p}", {"p_junior": p}) for p in self.cfg.eval_p] + \
                    [(f"after={k}", {"p_junior": 0.0, "junior_after": k}) for k in self.cfg.eval_after]
        job = self.job
        split = job.eval.split if isinstance(job.eval.split, str) else job.eval.split[0]
        suite = Suite(f"{job.env} handoff", entries=(SuiteEntry(job.env, split, job.eval.n, job.env_kwargs),))
        for name, schedule in schedules:
            results = run_suite(suite, self.policy(**schedule), renderer,
                                Path(os.path.expanduser(job.out_dir)) / "heldout" / label.replace(" ", "_")
                                / "handoff" / name, job.model, config=replace(job.eval.rollout, group_size=1))
            out[name] = results["all"]["success"]["rate"]
        log(f"handoff robustness ({split}): " + ", ".join(f"{k} {v:.3f}" for k, v in out.items()))
        return out


def run_dpo(job: TrainJob, model, tokenizer, policy, renderer, make_env, tasks, out: Path, log) -> dict[str, Any]:
    """Sample groups from the starting model once, pair best and worst of each, train DPO, save."""
    cfg = job.dpo
    engine = RolloutEngine(make_env, policy, renderer, replace(cfg.rollout, seed=cfg.seed))
    groups = asyncio.run(engine.run(tasks[:cfg.tasks]))
    engine.close()
    pairs = preference_pairs(groups, cfg.reward, cfg.min_margin, model)
    log(f"DPO: {len(pairs)} preference pairs from {len(groups)} tasks × {cfg.rollout.group_size} samples")
    history = train_dpo(model, pairs, cfg)
    asyncio.run(policy.sync_weights(model, 1))
    optimizer = torch.optim.AdamW(model.parameters())  # a fresh one: DPO is offline, there is nothing to resume
    save_checkpoint(out, 1, model, tokenizer, state={"weight_version": 1}, optimizer=optimizer)
    last = history[-1]
    log(f"DPO: {len(history)} steps, final loss {last['loss']:.3f}, reward accuracy {last['reward_accuracy']:.2f}")
    return {"pairs": len(pairs), "steps": len(history), "final_loss": last["loss"],
            "reward_accuracy": last["reward_accuracy"]}


def run_tango(job: TrainJob, model, tokenizer, policy, renderer, make_env, tasks, out: Path, log) -> None:
    """Verifier from the generator's starting weights → its format warm start → co-training."""
    cfg = job.tango
    verifier_model = copy.deepcopy(model)
    verifier_policy = HFPolicy(verifier_model, tokenizer)
    checker = make_env().check_step
    if latest_checkpoint(out) is None:  # else tango.train resumes from it (the verifier too)
        engine = RolloutEngine(make_env, policy, renderer, replace(job.grpo.rollout, group_size=1, seed=1))
        start = [t for g in asyncio.run(engine.run(tasks[:cfg.verifier_warmup])) for t in g.valid]
        engine.close()
        problems = {t.id: t.data.get("question", "") for t in tasks}
        vtasks = [tango.verification_task(t, problems[t.task_id], renderer, checker, i) for i, t in enumerate(start)]
        log(f"verifier warm start: SFT on outcome-only judgements of {len(vtasks)} starting episodes")
        tango.warm_start_verifier(verifier_model, vtasks, renderer, job.grpo.rollout, SFTConfig(epochs=2, lr=1e-3))
    verifier = tango.Verifier(verifier_model, verifier_policy, renderer, cfg, job.grpo)
    log(f"co-training: {job.grpo.steps} steps, process weight {cfg.alpha_start} → {cfg.alpha_end}")
    tango.train(cfg, job.grpo, model, tokenizer, policy, verifier, make_env, tasks, out, checker,
                on_step=lambda step, m: log(progress_line(step, job.grpo.steps, m) + tango_line(m)))
    asyncio.run(verifier_policy.close())


def demonstrations(make_env, tasks: list, renderer: Renderer, rollout: RolloutConfig, error_rate: float, seed: int,
                   path: Path) -> list:
    """Expert episodes (one per task) played through the real env and renderer, so SFT sees exact tokens
    and masks."""
    rng, env = random.Random(seed), make_env()
    # Each script is found by its task's own text in the prompt: the last user message the env opens with.
    scripts = {[m for m in env.first_messages(t) if m.role == "user"][-1].content: env.demonstration(t, rng, error_rate)
               for t in tasks}
    policy = ScriptedPolicy(renderer, playing(scripts), renderer.generation_prompt)
    engine = RolloutEngine(make_env, policy, renderer, replace(rollout, group_size=1))
    with JsonlWriter(path) as writer:
        groups = asyncio.run(engine.run(tasks, on_episode=writer.write))
    engine.close()
    return [t for g in groups for t in g.trajectories]


def _save_stage(model, tokenizer, path: Path) -> None:
    """A finished stage's model, written whole (`write_folder`); the summary records the stage only after this."""
    write_folder(path, lambda tmp: save_model(model, tokenizer, tmp))


def _load_stage(model, policy, path: Path, log: Callable[[str], None], version: int = 0) -> None:
    log(f"{path.name.removesuffix('_model')}: done in an earlier run; loading {path}")
    load_model(model, path)
    asyncio.run(policy.sync_weights(model, version))
