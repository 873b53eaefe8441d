"""`agentrl train RECIPE.toml`: optional SFT warm start on expert demonstrations → held-out evaluation →
GRPO → held-out evaluation, with a reward-curve plot and a summary. Resumable: a run killed during
GRPO continues from its latest checkpoint; finished stages are not redone.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
from pydantic import with_config
from transformers import AutoModelForCausalLM

from agentrl.config import STRICT
from agentrl.engines import EngineConfig, open_policy
from agentrl.evaluation import evaluate
from agentrl.hf_policy import HFPolicy
from agentrl.policy import SamplingParams
from agentrl.registration import make
from agentrl.renderer import Renderer
from agentrl.rollout import JsonlWriter, RolloutConfig, RolloutEngine, write_jsonl
from agentrl.scripted_policy import ScriptedPolicy, playing
from agentrl.tiny_model import load_tokenizer
from agentrl.trainers.checkpoint import latest_checkpoint
from agentrl.trainers.grpo import GRPOConfig, train as train_grpo
from agentrl.trainers.sft import SFTConfig, sft


@with_config(STRICT)
@dataclass(frozen=True)
class DemoSFT:
    """Warm start: imitate the env's expert demonstrations (`TextEnv.demonstration`)."""

    episodes: int = 256  # demonstration episodes, on the training split
    error_rate: float = 0.0  # the expert's deliberate mistake rate
    config: SFTConfig = field(default_factory=SFTConfig)


@with_config(STRICT)
@dataclass(frozen=True)
class EvalConfig:
    split: str | list[str] = "heldout"  # one split, or several held-out suites (each reported, then averaged)
    n: int = 200  # tasks per split, one episode each
    every: int = 0  # also evaluate every this many GRPO steps, logged with the training metrics (0: never)
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(sampling=SamplingParams(temperature=0.0)))


@with_config(STRICT)
@dataclass(frozen=True)
class TrainJob:
    env: str  # env id
    model: str  # model directory or hub name
    device: str = "cpu"  # where the trainer and the in-process sampler run, e.g. "cuda"
    dtype: str = "float32"  # or "bfloat16"
    out_dir: str = "runs/train"
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    train_tasks: int | None = None  # cap on training-split tasks (None: all)
    sft: DemoSFT | None = None
    eval: EvalConfig | None = field(default_factory=EvalConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)  # transformers in-process, or vLLM

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


def run(job: TrainJob, log: Callable[[str], None] = print) -> dict[str, Any]:
    out = Path(os.path.expanduser(job.out_dir))
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    tokenizer = load_tokenizer(job.model)
    renderer = Renderer(tokenizer)
    make_env = lambda split="train": make(job.env, split=split, **job.env_kwargs)  # noqa: E731
    env = make_env()
    tasks = list(env.tasks)[:job.train_tasks]
    if job.engine.kind == "transformers":  # the sampler shares the trainer's model: syncing is free
        policy = HFPolicy.load(job.model, device=job.device, dtype=getattr(torch, job.dtype))
        model = policy.model
    else:  # vLLM samples from its own copy; every sync into it is parity-checked on two task prompts
        prompts = [renderer.prompt_ids(env.first_messages(t), env.tool_schemas) for t in tasks[:2]]
        policy = open_policy(job.model, job.engine, parity_prompts=prompts)
        model = AutoModelForCausalLM.from_pretrained(os.path.expanduser(job.model),
                                                     dtype=getattr(torch, job.dtype)).to(job.device)

    resuming = latest_checkpoint(out) is not None
    if job.sft and not resuming:
        log(f"SFT: {job.sft.episodes} expert episodes (mistake rate {job.sft.error_rate})")
        demos = demonstrations(job, renderer, make_env, tasks, out / "sft_demos.jsonl")
        steps = job.sft.config.epochs * -(-len(demos) // job.sft.config.batch_size)
        history = sft(model, demos, job.sft.config, on_step=_sft_progress(steps, log))
        asyncio.run(policy.sync_weights(model, 0))
        summary["sft"] = {"steps": len(history), "final_loss": history[-1]["loss"], "kept": history[-1]["kept"]}
    if job.eval and "before" not in summary:
        summary["before"] = heldout(job, policy, renderer, make_env, log, "before GRPO")
        summary_path.write_text(json.dumps(summary, indent=2))

    log(f"GRPO: {job.grpo.steps} steps × {job.grpo.tasks_per_step} tasks × {job.grpo.rollout.group_size}")
    def periodic_eval(step: int) -> dict[str, Any]:
        due = job.eval and job.eval.every and step % job.eval.every == 0 and step < job.grpo.steps
        return heldout(job, policy, renderer, make_env, log, f"at step {step}") if due else {}

    train_grpo(job.grpo, model, tokenizer, policy, make_env, tasks, out,
               on_step=lambda step, m: log(_progress_line(step, job.grpo.steps, m)), periodic_eval=periodic_eval)
    if job.eval:
        summary["after"] = heldout(job, policy, renderer, make_env, log, "after GRPO")
    summary_path.write_text(json.dumps(summary, indent=2))
    plot_reward_curve(out / "metrics.jsonl", out / "reward_curve.png")
    asyncio.run(policy.close())
    return summary


def demonstrations(job: TrainJob, renderer: Renderer, make_env, tasks, path: Path):
    """Expert episodes played through the real env and renderer, so SFT sees exact tokens and masks."""
    rng, env = random.Random(job.grpo.seed), make_env()
    picked = [tasks[i % len(tasks)] for i in range(job.sft.episodes)]
    scripts = {t.data["question"]: env.demonstration(t, rng, job.sft.error_rate) for t in picked}
    policy = ScriptedPolicy(renderer, playing(scripts), renderer.generation_prompt)
    engine = RolloutEngine(make_env, policy, renderer, replace(job.grpo.rollout, group_size=1))
    with JsonlWriter(path) as writer:
        groups = asyncio.run(engine.run(picked, on_episode=writer.write))
    engine.close()
    return [t for g in groups for t in g.trajectories]


def heldout(job: TrainJob, policy, renderer, make_env, log, label: str) -> dict[str, Any]:
    """Metrics of one split; for several, each split's under `suites` and their means on top."""
    splits = [job.eval.split] if isinstance(job.eval.split, str) else job.eval.split
    suites = {}
    for split in splits:
        tasks = list(make_env(split).tasks)[:job.eval.n]
        metrics, trajectories = evaluate(policy, renderer, lambda split=split: make_env(split), tasks,
                                         job.eval.rollout)
        write_jsonl(trajectories, Path(os.path.expanduser(job.out_dir)) / "heldout" / label.replace(" ", "_")
                    / f"{split}.jsonl")  # for `agentrl report`'s viewer
        log(f"held-out ({split}, {len(tasks)} tasks) {label}: success {metrics['success']:.3f}, "
            f"mean reward {metrics['mean_reward']:.3f}")
        suites[split] = metrics
    if len(suites) == 1:
        return metrics
    mean = {k: sum(m[k] for m in suites.values()) / len(suites) for k in ("success", "mean_reward")}
    return {**mean, "suites": suites}


def plot_reward_curve(metrics_path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display here
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["mean_reward"] for r in rows], label="mean reward")
    ax.plot([r["step"] for r in rows], [r["success"] for r in rows], label="success")
    ax.set_xlabel("GRPO step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def _sft_progress(steps: int, log: Callable[[str], None]) -> Callable[[dict], None]:
    """Logs the loss about every tenth of the SFT steps (an upper bound: the filter may drop some demos)."""
    done = 0

    def on_step(row: dict) -> None:
        nonlocal done
        done += 1
        if done % max(1, steps // 10) == 0:
            log(f"SFT step {done}/{steps}  epoch {row['epoch']}  loss {row['loss']:.3f}")

    return on_step


def _progress_line(step: int, steps: int, m: dict[str, Any]) -> str:
    return (f"step {step}/{steps}  reward {m['mean_reward']:.3f}  success {m['success']:.3f}  "
            f"entropy {m.get('entropy', float('nan')):.3f}  kl {m.get('approx_kl', float('nan')):.4f}  "
            f"rollout {m['time']['rollout']:.1f}s train {m['time']['train']:.1f}s")
