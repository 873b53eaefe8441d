"""Generator–process-verifier co-training (RL Tango, Zha et al. 2025), on top of the GRPO pieces.

A verifier model reads a generator trajectory (the problem, then each assistant step with what the env
answered) and writes a judgement, one line per step and a final verdict:

    Step 1: correct
    Step 2: incorrect
    Verdict: incorrect

Each co-training step:
1. the generator plays `tasks_per_step` groups on its env (outcome reward from the env);
2. the verifier judges every valid trajectory, `verifier_group_size` times; the share of steps judged
   correct, averaged over those judgements, is the trajectory's process reward;
3. the generator's training reward is  R = α·process + (1−α)·outcome,  α going linearly from
   `alpha_start` to `alpha_end` over the run (process supervision early, outcome later);
4. the verifier is trained with GRPO from outcome-level correctness only: reward 1 when its judgement is
   complete (every step judged) and its final verdict matches the env's outcome. It never sees a
   step-level label, so its step verdicts are learned, not copied.

The metrics report how often the verifier's step verdicts agree with the env's own process checker, when
the env has one (`step_checker`, e.g. the math env's `step_is_correct`).

The verifier starts from a copy of the generator's starting weights, with a short format warm start:
SFT on judgements of the starting generator's own trajectories whose every line is the outcome
(again no step-level label).
"""

from __future__ import annotations

import asyncio
import copy
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from pydantic import with_config
from transformers import AutoModelForCausalLM

from agentrl.config import STRICT
from agentrl.env.api import TextEnv
from agentrl.policy.hf import HFPolicy
from agentrl.policy.protocol import Policy
from agentrl.policy.scripted import ScriptedPolicy, playing
from agentrl.renderer import Renderer
from agentrl.rollout import seeds
from agentrl.rollout.engine import EnvEngines, RolloutConfig, RolloutEngine
from agentrl.trainers.checkpoint import latest_checkpoint
from agentrl.trainers.distributed import Sharding, restore
from agentrl.trainers.loop import Hooks, run, update
from agentrl.trainers.methods.grpo import GRPOConfig, to_batch
from agentrl.trainers.methods.stage import RLStage
from agentrl.trainers.metrics import rollout_metrics
from agentrl.trainers.progress import progress_line
from agentrl.trainers.sft import SFTConfig, sft
from agentrl.types import Group, Message, Task, Trajectory

if TYPE_CHECKING:
    from agentrl.trainers.job.recipe import TrainJob

StepChecker = Callable[[str], "bool | None"]  # one step's text -> correct / incorrect / nothing to check
VERIFIER_PROMPT = ("You check solutions step by step. For each step write 'Step <n>: correct' or "
                   "'Step <n>: incorrect' on its own line, then 'Verdict: correct' or 'Verdict: incorrect' "
                   "for the final answer.")
_STEP = re.compile(r"^\s*Step\s+(\d+)\s*:\s*(correct|incorrect)\b", re.M | re.I)
_VERDICT = re.compile(r"^\s*Verdict\s*:\s*(correct|incorrect)\b", re.M | re.I)


@with_config(STRICT)
@dataclass(frozen=True)
class TangoConfig:
    alpha_start: float = 0.5  # weight of the process reward at the first step...
    alpha_end: float = 0.0  # ...and at the last, linearly in between
    verifier_group_size: int = 4  # judgements per generator trajectory (GRPO group of the verifier)
    verifier_lr: float = 1e-4
    verifier_warmup: int = 256  # format warm start: judgements of the starting generator's episodes
    verifier_max_tokens: int = 48

    def __post_init__(self) -> None:
        for name in ("alpha_start", "alpha_end"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.verifier_group_size < 2:
            raise ValueError("verifier_group_size must be >= 2: the verifier is trained with GRPO")


def process_weight(step: int, steps: int, start: float, end: float) -> float:
    """α at 0-based `step` of `steps`: `start` at the first, `end` at the last, linear in between."""
    return start if steps <= 1 else start + (end - start) * step / (steps - 1)


def combined_reward(outcome: float, process: float, alpha: float) -> float:
    """The generator's training reward R = α·process + (1−α)·outcome, with α = `alpha`."""
    return alpha * process + (1.0 - alpha) * outcome


@dataclass(frozen=True)
class Judgement:
    steps: dict[int, bool]  # step number (1-based) -> judged correct
    verdict: bool | None  # None: no final verdict (malformed)


def parse_judgement(text: str) -> Judgement:
    """The first verdict per step number, and the final verdict."""
    steps: dict[int, bool] = {}
    for number, word in _STEP.findall(text):
        steps.setdefault(int(number), word.lower() == "correct")
    final = _VERDICT.search(text)
    return Judgement(steps, None if final is None else final.group(1).lower() == "correct")


def step_share(judgement: Judgement, n_steps: int) -> float:
    """Share of the trajectory's steps judged correct; a step the verifier skipped counts as incorrect."""
    return sum(judgement.steps.get(i, False) for i in range(1, n_steps + 1)) / max(n_steps, 1)


def format_judgement(steps: Sequence[bool], verdict: bool) -> str:
    """A judgement in the verifier's format: a `Step <n>: correct|incorrect` line per step, then the verdict line."""
    word = {True: "correct", False: "incorrect"}
    return "\n".join([*(f"Step {i}: {word[v]}" for i, v in enumerate(steps, 1)), f"Verdict: {word[verdict]}"])


def trajectory_steps(t: Trajectory, renderer: Renderer) -> list[tuple[str, str]]:
    """(what the assistant wrote, what came back) per turn: the sampled text verbatim (decoded from the
    trajectory's ids, without the turn end), and the observation messages' contents."""
    observations, current = [], None
    for m in t.messages:
        if m.role == "assistant":
            current = []
            observations.append(current)
        elif current is not None:
            current.append(m.content)
    steps = []
    for turn, obs in zip(t.turns, observations + [[]] * len(t.turns)):
        ids = [i for i in t.token_ids[turn.start:turn.end] if i not in renderer.stop_token_ids]
        steps.append((renderer.decode(ids).strip(), " / ".join(obs)))
    return steps


def verification_task(t: Trajectory, problem: str, renderer: Renderer, checker: StepChecker | None,
                      index: int = 0) -> Task:
    """The verifier's task for trajectory `t` of `problem`: the problem and each step (with its result) as the question.

    Its data also holds the number of steps, the outcome (outcome reward >= 1) and `checker`'s verdict per step
    (None without a checker); `index` (the trajectory's) makes the task ids of one task's trajectories unique."""
    steps = trajectory_steps(t, renderer)
    lines = [f"Problem: {problem}"]
    for i, (text, observation) in enumerate(steps, 1):
        lines.append(f"Step {i}: {text}" + (f"\nResult {i}: {observation}" if observation else ""))
    return Task(f"verify-{index:05d}-{t.task_id}", {
        "question": "\n".join(lines), "n_steps": len(steps),
        "outcome": t.reward_components.get("outcome", t.reward) >= 1.0,
        "checker": [checker(text) if checker else None for text, _ in steps]}, split="train")


class VerifierEnv(TextEnv):
    """One turn: read a trajectory, write a judgement. Reward 1 when the judgement is complete (a verdict
    for every step, and a final one) and the final verdict matches the outcome; else 0. Completeness is a
    format rule, not a step label: without it RL learns to skip the step lines (measured: with the final
    verdict alone rewarded, the verifier wrote only `Step 1` within 20 steps)."""

    def __init__(self, tasks: Sequence[Task] = ()):
        super().__init__(split="train", max_turns=1)
        self._given = tuple(tasks)

    def load_tasks(self, split: str) -> Sequence[Task]:
        """The tasks given to the constructor, whatever the split."""
        return self._given

    def first_messages(self, task: Task) -> Sequence[Message]:
        """The verifier's instructions, and the task's problem and steps as the user message."""
        return Message("system", VERIFIER_PROMPT), Message("user", task.data["question"])

    def act(self, action: str):
        judgement = parse_judgement(action)
        complete = all(i in judgement.steps for i in range(1, self.task.data["n_steps"] + 1))
        correct = complete and judgement.verdict is not None and judgement.verdict == self.task.data["outcome"]
        return [], float(correct), True, {"reward_components": {"outcome": float(correct)},
                                          "answer": None if judgement.verdict is None else str(judgement.verdict)}

    def gold_actions(self, task: Task) -> list[str]:
        """The checker's step verdicts (a step with nothing to check counts as correct) and the outcome."""
        steps = [v is not False for v in task.data["checker"]]
        return [format_judgement(steps, task.data["outcome"])]

    def demonstration(self, task: Task, rng, error_rate: float = 0.0) -> list[str]:
        """Format warm start from outcomes only: every step line repeats the final verdict."""
        return [format_judgement([task.data["outcome"]] * task.data["n_steps"], task.data["outcome"])]


def agreement(tasks: Sequence[Task], judgements: Sequence[Judgement]) -> float:
    """Share of checkable steps where the verifier's verdict equals the env's process checker's."""
    hits, n = 0, 0
    for task, judgement in zip(tasks, judgements):
        for i, truth in enumerate(task.data["checker"], 1):
            if truth is not None:
                n += 1
                hits += judgement.steps.get(i) == truth
    return hits / n if n else float("nan")


class Verifier:
    """The verifier's model, policy, optimizer and GRPO settings: what its half of the loop needs."""

    def __init__(self, model: torch.nn.Module, policy: Policy, renderer: Renderer, cfg: TangoConfig,
                 grpo: GRPOConfig):
        self.model, self.policy, self.renderer = model, policy, renderer
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.verifier_lr)
        sampling = replace(grpo.rollout.sampling, max_tokens=cfg.verifier_max_tokens)
        self.grpo = replace(grpo, group_size=cfg.verifier_group_size, rollout=replace(grpo.rollout, sampling=sampling),
                            lr=cfg.verifier_lr)

    def judge(self, tasks: Sequence[Task], seed: int) -> list[Group]:
        """One group of `verifier_group_size` judgements per task, sampled from the verifier's policy with `seed`."""
        with RolloutEngine(lambda: VerifierEnv(tasks), self.policy, self.renderer,
                           replace(self.grpo.rollout, group_size=self.grpo.group_size, seed=seed)) as engine:
            return asyncio.run(engine.run(tasks))

    def train_on(self, groups: Sequence[Group], step: int) -> dict[str, float]:
        """One GRPO update of the verifier on the groups with two or more valid judgements, then a weight sync.

        Returns the update's metrics; `{}` (and no update) when no group qualifies."""
        kept = [g for g in groups if len(g.valid) >= 2]
        if not kept:
            return {}
        batch = to_batch(kept, self.grpo.advantage, [[t.reward for t in g.valid] for g in kept])
        metrics = update(self.model, None, self.optimizer, batch, self.grpo, torch.Generator().manual_seed(step))
        asyncio.run(self.policy.sync_weights(self.model, step + 1))
        return metrics


class Tango:
    """RL Tango's part of the loop: the verifier judges each kept trajectory's steps, the generator trains on the
    outcome mixed with that process reward, then the verifier trains on its own judgements' rewards. The
    verifier and its optimizer are part of every checkpoint."""

    def __init__(self, cfg: TangoConfig, grpo: GRPOConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 verifier: Verifier, renderer: Renderer, checker: StepChecker | None, tasks: list[Task]):
        self.cfg, self.grpo, self.model, self.optimizer, self.verifier = cfg, grpo, model, optimizer, verifier
        self.renderer, self.checker, self.refills = renderer, checker, 0
        self.problems = {t.id: t.data.get("question", "") for t in tasks}

    @staticmethod
    def keep(group: Group) -> bool:
        """A group with a baseline: two valid episodes."""
        return len(group.valid) >= 2

    def train_step(self, kept: list[Group], collected: list[Group], step: int) -> dict:
        """The verifier's judgements, the generator's update on outcome + process reward, the verifier's update."""
        cfg, grpo, renderer = self.cfg, self.grpo, self.renderer
        t0 = time.perf_counter()
        trajectories = [t for g in kept for t in g.valid]
        vtasks = [verification_task(t, self.problems[t.task_id], renderer, self.checker, i)
                  for i, t in enumerate(trajectories)]
        vgroups = self.verifier.judge(vtasks, seed=seeds.step_seed(grpo.seed, step))
        judging = time.perf_counter() - t0
        judgements = [[parse_judgement(trajectory_steps(v, renderer)[0][0]) for v in g.valid] for g in vgroups]
        process = iter([sum(step_share(j, task.data["n_steps"]) for j in js) / max(len(js), 1)
                        for task, js in zip(vtasks, judgements)])  # in the order of `trajectories`
        alpha = process_weight(step, grpo.steps, cfg.alpha_start, cfg.alpha_end)
        rewards = [[combined_reward(t.reward_components.get("outcome", t.reward), next(process), alpha)
                    for t in g.valid] for g in kept]
        train_rewards = [r for rs in rewards for r in rs]
        metrics = {}
        if kept:
            metrics.update(update(self.model, None, self.optimizer, to_batch(kept, grpo.advantage, rewards), grpo,
                                  torch.Generator().manual_seed(grpo.seed + step)))
        flat = [j for js in judgements for j in js]
        return {**metrics, "alpha": alpha, "train_reward": sum(train_rewards) / max(len(train_rewards), 1),
                "verifier": {**rollout_metrics(vgroups, 1.0),
                             "format_rate": sum(j.verdict is not None for j in flat) / max(len(flat), 1),
                             "step_agreement": agreement([task for task, js in zip(vtasks, judgements) for _ in js],
                                                         flat),
                             **self.verifier.train_on(vgroups, step)},
                "time": {"verifier_rollout": judging}}

    def checkpoint_state(self, sharding: Sharding) -> tuple[dict, dict]:
        """The verifier and its optimizer state (tango runs in one process)."""
        return {"verifier_optimizer": self.verifier.optimizer.state_dict()}, {"verifier": self.verifier.model}

    def restore(self, checkpoint: Path, state: dict) -> None:
        """The verifier and its optimizer from the checkpoint's `verifier/`, synced into its policy."""
        restore(self.verifier.model, self.verifier.optimizer, checkpoint / "verifier", state["verifier_optimizer"],
                AutoModelForCausalLM)
        asyncio.run(self.verifier.policy.sync_weights(self.verifier.model, state["weight_version"]))


def train(cfg: TangoConfig, grpo: GRPOConfig, model: torch.nn.Module, tokenizer: Any, policy: Policy,
          verifier: Verifier, make_env: Callable[[], TextEnv], tasks: list[Task], out_dir: Path,
          checker: StepChecker | None = None, on_step: Callable[[int, dict], None] | None = None) -> list[dict]:
    """Alternates generator and verifier GRPO updates for `grpo.steps` steps of the RL loop, resuming from the
    latest checkpoint in `out_dir` like the others; returns the metrics of the steps run now. The final verifier
    is also saved on its own, in `out_dir/verifier`."""
    torch.manual_seed(grpo.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=grpo.lr)
    tango = Tango(cfg, grpo, model, optimizer, verifier, Renderer(tokenizer), checker, tasks)
    history = run(grpo, tango, tokenizer, policy, EnvEngines(make_env), tasks, out_dir, Hooks(on_step=on_step))
    verifier.model.save_pretrained(out_dir / "verifier")
    tokenizer.save_pretrained(out_dir / "verifier")
    return history


def warm_start_verifier(verifier_model: torch.nn.Module, verification_tasks: Sequence[Task], renderer: Renderer,
                        rollout: RolloutConfig, sft_config: SFTConfig) -> list[dict]:
    """SFT the verifier on outcome-only judgements (`VerifierEnv.demonstration`) of these tasks."""
    env = VerifierEnv(verification_tasks)
    scripts = {t.data["question"]: env.demonstration(t, None) for t in verification_tasks}
    with RolloutEngine(lambda: VerifierEnv(verification_tasks),
                       ScriptedPolicy(renderer, playing(scripts), renderer.generation_prompt),
                       renderer, replace(rollout, group_size=1)) as engine:
        demos = [t for g in asyncio.run(engine.run(list(verification_tasks))) for t in g.trajectories]
    return sft(verifier_model, demos, sft_config)


def progress(m: dict[str, Any]) -> str:
    """What a tango step adds to the loop's progress line: the process reward's weight and the verifier's scores."""
    v = m["verifier"]
    return (f"  α {m['alpha']:.2f}  verifier: accuracy {v['success']:.2f} format {v['format_rate']:.2f} "
            f"step agreement {v['step_agreement']:.2f}")


class TangoStage(RLStage):
    """`[tango]`: GRPO with a co-trained process verifier: the verifier from the generator's starting weights → its
    format warm start → co-training."""

    @staticmethod
    def check(job: TrainJob) -> None:
        if job.engine.kind != "transformers":
            raise ValueError("[tango] trains the verifier in-process: set engine.kind = 'transformers'")

    def train(self) -> dict[str, Any]:
        s, cfg, grpo = self.setup, self.setup.job.tango, self.setup.job.grpo
        verifier_model = copy.deepcopy(s.model)
        verifier_policy = HFPolicy(verifier_model, s.tokenizer)
        checker = s.make_env().check_step
        if latest_checkpoint(s.out) is None:  # else `train` resumes from it (the verifier too)
            first = replace(grpo.rollout, group_size=1, seed=1)
            with RolloutEngine(s.make_env, s.policy, s.renderer, first) as engine:
                start = [t for g in asyncio.run(engine.run(s.tasks[:cfg.verifier_warmup])) for t in g.valid]
            problems = {t.id: t.data.get("question", "") for t in s.tasks}
            vtasks = [verification_task(t, problems[t.task_id], s.renderer, checker, i) for i, t in enumerate(start)]
            s.log(f"verifier warm start: SFT on outcome-only judgements of {len(vtasks)} starting episodes")
            warm_start_verifier(verifier_model, vtasks, s.renderer, grpo.rollout, SFTConfig(epochs=2, lr=1e-3))
        verifier = Verifier(verifier_model, verifier_policy, s.renderer, cfg, grpo)
        s.log(f"co-training: {grpo.steps} steps, process weight {cfg.alpha_start} → {cfg.alpha_end}")
        train(cfg, grpo, s.model, s.tokenizer, s.policy, verifier, s.make_env, s.tasks, s.out, checker,
              on_step=lambda step, m: s.log(progress_line(step, grpo.steps, m) + progress(m)))
        asyncio.run(verifier_policy.close())
        return {}
