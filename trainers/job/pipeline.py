"""`agentrl train RECIPE.toml`: warm starts (copy warm-up, SFT on expert demonstrations) → held-out evaluation →
the RL method's stage → held-out evaluation, with a reward-curve plot and a summary. The RL method is the one of
`METHODS` whose table the recipe has, else GRPO; `[lora]` trains LoRA adapters instead of all weights, in every
stage. Resumable: a run killed during RL continues from its latest checkpoint and finished stages are not redone;
the resolved job is in OUT/job.json, and a resume with another job is refused.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Coroutine

import torch
from pydantic import TypeAdapter
from transformers import AutoModelForCausalLM

from agentrl.config import ConfigError, load_config
from agentrl.env.api import TextEnv
from agentrl.env.registry import make
from agentrl.eval.report import plot_reward_curve, plot_timeline
from agentrl.gateway.agents import AgentEngines
from agentrl.models.tokenizer import load_tokenizer
from agentrl.policy.backends import open_policy
from agentrl.policy.hf import HFPolicy
from agentrl.policy.parity import PROBE_TEXT
from agentrl.policy.precision import mixed_precision
from agentrl.policy.scripted import ScriptedPolicy, playing
from agentrl.renderer import Renderer
from agentrl.rollout.context import ContextConfig
from agentrl.rollout.engine import RolloutConfig, RolloutEngine
from agentrl.rollout.jsonl import JsonlWriter, read_records
from agentrl.rollout.ray_pool import env_factory
from agentrl.system.files import write_folder
from agentrl.trainers import distributed
from agentrl.trainers.checkpoint import checkpoint_step, latest_checkpoint, save_model
from agentrl.trainers.job.heldout import evaluate_heldout
from agentrl.trainers.job.recipe import TrainJob
from agentrl.trainers.lora import add_lora, freeze_base_in
from agentrl.trainers.methods import METHODS
from agentrl.trainers.methods.stage import Setup
from agentrl.trainers.pretrain import alphabet, copy_in_context, copy_warmup, vocabulary
from agentrl.trainers.progress import mean_of_last, stage_progress
from agentrl.trainers.rewards import RewardConfig
from agentrl.trainers.rewards.judge import close_judges, judge_for
from agentrl.trainers.sft import sft


class JobMismatch(ValueError):
    """OUT holds a run of another job: resuming into it would mix two jobs' results."""


def run(job: TrainJob, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole job; resumable. Under torchrun (several processes), the GRPO trainer is sharded with FSDP2
    over the ranks and rank 0 samples, evaluates and writes (`trainers/distributed.py`, docs/scaling.md)."""
    ranks = distributed.join()
    if ranks.sharded:
        check_shardable(job)
        log = log if ranks.main else (lambda message: None)
    out = Path(os.path.expanduser(job.out_dir))
    out.mkdir(parents=True, exist_ok=True)
    if ranks.main:
        record_job(job, out)
    METHODS[job.method].stage.preflight(job)
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    save = lambda: summary_path.write_text(json.dumps(summary, indent=2))  # noqa: E731
    setup = set_up(job, out, ranks, log)
    warm_start(setup, summary, save)
    stage = METHODS[job.method].stage(setup)

    def evaluate(label: str, weights: str | None = None) -> dict[str, Any]:  # the weights: the label's, by default
        metrics, trajectories = setup.heldout(label, weights=weights or label)
        return {**metrics, **stage.heldout(trajectories, label)}

    if job.eval and "before" not in summary and ranks.main:
        summary["before"] = evaluate("before RL")
        save()
    reward = job.settings.reward
    summary["method"] = job.method + (f" ({reward.describe()})" if reward != RewardConfig() else "")
    steps = job.rl.steps if METHODS[job.method].loop else None  # no RL loop, no steps: nothing to extend
    spent = keep_finished_evaluation(out, summary, steps) if ranks.main else 0.0
    started = time.perf_counter()
    if stage.trains():
        summary.update(stage.train())
    else:
        log("No RL stage (steps = 0).")
    if not ranks.main:  # rank 0 evaluates and writes
        return summary
    summary["rl_seconds"] = round(spent + time.perf_counter() - started, 1)
    if job.eval and stage.trains():
        summary["after"] = evaluate("after RL", f"after {steps} RL steps" if steps else None)
    save()
    if (out / "metrics.jsonl").exists():
        rows = read_records(out / "metrics.jsonl")
        (out / "reward_curve.png").write_bytes(plot_reward_curve(rows))
        if any("timeline" in row for row in rows):
            (out / "timeline.png").write_bytes(plot_timeline(rows))
    stage.close()
    asyncio.run(setup.policy.close())
    close_judges()
    return summary


def keep_finished_evaluation(out: Path, summary: dict[str, Any], steps: int | None) -> float:
    """A finished run extended (its `steps` raised): its evaluation after RL stays, as the step it was taken at
    (OUT/heldout/at_step_N, the summary's "at step N"), rather than being replaced by the extension's. Returns the RL
    seconds it had spent, which the extension's add to. `steps` is None for a method without an RL loop."""
    if "after" not in summary or steps is None:  # not finished (a run killed in RL loses the time before)
        return 0.0
    finished = latest_checkpoint(out)
    step = checkpoint_step(finished) if finished else steps
    if step < steps:
        after, kept = out / "heldout" / "after_RL", out / "heldout" / f"at_step_{step}"
        if after.exists() and not kept.exists():
            after.rename(kept)
        summary[f"at step {step}"] = summary.pop("after")
    return summary.get("rl_seconds", 0.0)


def record_job(job: TrainJob, out: Path) -> None:
    """OUT/job.json: the resolved job (the recipe after overrides, derived tables and defaults). A run folder that
    holds another job is refused, the keys that differ named; the RL loop's `steps` may change (a finished run is
    extended), and so may `out_dir` (a run folder moved or copied resumes where it is). A key that a newer agentrl
    added reads, in a job.json written before it, as its default."""
    path, record = out / "job.json", job_record(job)
    if path.exists():
        try:
            previous = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise JobMismatch(f"{path} does not read back ({e}): delete it to resume with this job") from None
        try:
            previous = job_record(load_config(TrainJob, previous))  # the keys it lacks, at their defaults
        except (ConfigError, ValueError):
            pass  # a key this agentrl no longer has, or a value it refuses: compared as written, and named
        before, now = leaves(previous), leaves(record)
        free = {f"{METHODS[job.method].settings}.steps", "out_dir"}
        changed = [key for key in sorted(before.keys() | now.keys())
                   if before.get(key) != now.get(key) and key not in free]
        if changed:
            raise JobMismatch(f"{out} holds a run of another job: {', '.join(changed)} differ from its job.json. "
                              "Use a new out_dir, or put those keys back, to resume.")
    path.write_text(json.dumps(record, indent=2) + "\n")


def job_record(job: TrainJob) -> dict[str, Any]:
    """The job as JSON: every key, defaults included; `load_config(TrainJob, job_record(job))` gives it back."""
    return TypeAdapter(TrainJob).dump_python(job, mode="json")


def leaves(data: Any, prefix: str = "") -> dict[str, Any]:
    """The dotted keys of a nested dict and their values (a list, or an empty table, is one value)."""
    if not isinstance(data, dict) or not data:
        return {prefix: data}
    return {key: value for k, v in data.items() for key, value in leaves(v, f"{prefix}.{k}" if prefix else k).items()}


def set_up(job: TrainJob, out: Path, ranks: distributed.Ranks, log: Callable[[str], None]) -> Setup:
    """The tokenizer, the envs, the sampler (rank 0: in-process, or vLLM with every sync parity-checked on two task
    prompts) and the trainer's model, each failing now if it cannot work rather than after the first evaluation."""
    tokenizer = load_tokenizer(job.model, job.chat_template)
    renderer, env = Renderer(tokenizer), make(job.env, **job.env_kwargs)
    env.check_ready()  # a Docker daemon or a Chromium the episodes need: EnvNotReady now, not every episode an error
    make_env, tasks = env_factory(job.env, job.env_kwargs, job.ray), list(env.tasks)[:job.train_tasks]
    # fp32 master weights whose forwards compute in dtype under autocast (agentrl/policy/precision.py), unless
    # master_weights = false keeps the parameters in dtype itself
    compute, in_process = getattr(torch, job.dtype), job.engine.kind == "transformers"
    param_dtype = torch.float32 if job.master_weights else compute
    autocast_dtype = compute if compute != param_dtype else None
    policy = None
    if ranks.main and in_process:
        policy = HFPolicy.load(job.model, device=job.device, dtype=param_dtype)
        mixed_precision(policy.model, autocast_dtype)  # samples with the trainer's numerics (it may share the model)
    elif ranks.main:
        prompts = [renderer.prompt_ids(env.first_messages(t), env.tool_schemas) for t in tasks[:2]]
        policy = open_policy(job.model, job.engine, parity_prompts=prompts,
                             parity_probe=tokenizer.encode(PROBE_TEXT, add_special_tokens=False),
                             adapters=job.rl.max_staleness + 1 if job.lora else 0)
    if in_process and not ranks.sharded and not job.rl.max_staleness:  # the sampler shares the trainer's model: free syncs
        model = policy.model
    elif ranks.sharded:  # the trainer sharded over the ranks under torchrun
        model = distributed.from_pretrained(os.path.expanduser(job.model), param_dtype, autocast_dtype, job.device)
    else:  # the trainer has its own copy (asynchronous: the sampler runs on)
        model = AutoModelForCausalLM.from_pretrained(os.path.expanduser(job.model), dtype=param_dtype).to(job.device)
        mixed_precision(model, autocast_dtype)
    if job.lora:  # in place: the in-process sampler holds this very model
        add_lora(model, job.lora)
        if not ranks.sharded:  # bfloat16: the frozen base needs no float32 master copy (FSDP keeps one dtype)
            freeze_base_in(model, compute)
    if job.gradient_checkpointing:  # non-reentrant: works when the embeddings are frozen (LoRA)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if (prepare := getattr(policy, "prepare_sync", None)) is not None:  # vLLM: a sync that cannot work fails now
        asyncio.run(prepare(model, job.context))
    if job.rl.reward.judge is not None:  # so does a judge that cannot judge (loaded or reached once, here)
        judge_for(job.rl.reward.judge)
    engines = AgentEngines(job.agent) if job.agent else None  # else the env's episodes

    def evaluate(label: str, execute: Callable[[Coroutine], Any] = asyncio.run,
                 weights: str | None = None) -> tuple[dict[str, Any], list]:
        return evaluate_heldout(job, policy, renderer, make_env, log, label, engines, execute, weights)

    return Setup(job, model, tokenizer, policy, renderer, make_env, tasks, out, log, engines, evaluate)


def check_shardable(job: TrainJob) -> None:
    """What a sharded (torchrun) job supports so far; the rest is a clear error, not a silent single process."""
    unsupported = [name for name in ("warmup", "sft", "lora") if getattr(job, name)]
    unsupported += [] if METHODS[job.method].shardable else [job.method]
    unsupported += ["max_staleness"] if job.rl.max_staleness else []
    if unsupported:
        raise ValueError(f"a sharded (torchrun) job runs the GRPO or PPO loop only; remove {unsupported}. Run warm "
                         "starts in one process first and set model to their output (e.g. runs/X/sft_model).")
    if job.engine.kind == "vllm" and job.engine.weight_transfer == "ipc":
        raise ValueError("weight_transfer 'ipc' hands the engine one GPU's memory, and a sharded trainer's weights "
                         "are spread over the ranks' GPUs: use 'nccl' (an engine on GPUs of its own) or 'gloo'")


def warm_start(setup: Setup, summary: dict[str, Any], save: Callable[[], None]) -> None:
    """Copy warm-up, then SFT on expert demonstrations, each if the recipe asks. A stage that finished in an
    earlier run is loaded from its saved model, not redone."""
    job, model, tokenizer, policy, log = setup.job, setup.model, setup.tokenizer, setup.policy, setup.log
    out, make_env, tasks, renderer, env = setup.out, setup.make_env, setup.tasks, setup.renderer, setup.make_env()
    if job.warmup and "warmup" in summary and "sft" not in summary:
        setup.load(out / "warmup_model")
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
        setup.load(out / "sft_model")
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


def demonstrations(make_env, tasks: list, renderer: Renderer, rollout: RolloutConfig, error_rate: float, seed: int,
                   path: Path) -> list:
    """Expert episodes (one per task) played through the real env and renderer, so SFT sees exact tokens
    and masks. An env with an `expert_turn` plays it with the rollout's context policy (the expert writes the
    summaries, and errs at `error_rate`, drawn from the seed and the prompt so that a rerun plays the same
    episodes); otherwise the env's scripts play whole, in one segment up to `max_total_tokens` (a script writes no
    summaries)."""
    rng, env = random.Random(seed), make_env()
    context = rollout.context
    if type(env).expert_turn is not TextEnv.expert_turn:
        request = context.summary_prompt  # the request ends the prompt, before the assistant's generation prompt

        def respond(prompt: str, turn: int) -> str:
            mistake = random.Random(f"{seed}:{prompt}").random() < error_rate
            return env.expert_turn(prompt, request in prompt[-len(request) - 80:], mistake)
    else:
        # Each script is found by its task's own text in the prompt: the last user message the env opens with.
        respond, context = playing({[m for m in env.first_messages(t) if m.role == "user"][-1].content:
                                    env.demonstration(t, rng, error_rate) for t in tasks}), ContextConfig()
    policy = ScriptedPolicy(renderer, respond, renderer.generation_prompt)
    one_each = replace(rollout, group_size=1, context=context)
    with RolloutEngine(make_env, policy, renderer, one_each) as engine, JsonlWriter(path) as writer:
        groups = asyncio.run(engine.run(tasks, on_episode=writer.write))
    return [t for g in groups for t in g.trajectories]


def _save_stage(model, tokenizer, path: Path) -> None:
    """A finished stage's model, written whole (`write_folder`); the summary records the stage only after this."""
    write_folder(path, lambda tmp: save_model(model, tokenizer, tmp))
