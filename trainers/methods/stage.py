"""What a method's RL stage is given by the job, and what it gives back: `Setup` and `RLStage`.

`agentrl train` (`trainers/job/pipeline.py`) sets up the tokenizer, the envs, the sampler and the trainer's model,
runs the warm starts, then makes `METHODS[job.method].stage(setup)`: held-out evaluation before, `train()`,
held-out evaluation after, `close()`. A new method is one module with its config and its `RLStage`, and one entry
of `METHODS` (docs/methods.md, "A new method").
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Coroutine

import torch

from agentrl.env.api import TextEnv
from agentrl.policy.protocol import Policy
from agentrl.renderer import Renderer
from agentrl.rollout.engine import Engines
from agentrl.trainers.checkpoint import load_model
from agentrl.trainers.loop import LoopConfig
from agentrl.trainers.progress import progress_line
from agentrl.types import Task, Trajectory

if TYPE_CHECKING:  # the job's config imports the method table, which imports the methods
    from agentrl.trainers.job.recipe import TrainJob

Heldout = Callable[..., tuple[dict[str, Any], list[Trajectory]]]  # (label, execute, weights): `evaluate_heldout`


@dataclass
class Setup:
    """What the job made before the RL stage; the same objects for the warm starts, the stage and the evaluations."""

    job: TrainJob
    model: torch.nn.Module  # the trainer's policy (the in-process sampler's own model when they share it)
    tokenizer: Any
    policy: Policy | None  # the sampler: in-process or vLLM (None on the ranks > 0 of a sharded run)
    renderer: Renderer
    make_env: Callable[..., TextEnv]  # the job's env (`make_env(split)` for another split)
    tasks: list[Task]  # the training tasks
    out: Path  # the run's folder
    log: Callable[[str], None]
    engines: Engines | None  # agent programs through the gateway (`[agent]`), else None: the env's episodes
    heldout: Heldout  # (metrics, trajectories) of the held-out evaluation `label`, its episodes run by `execute`

    def load(self, path: Path, version: int = 0) -> None:
        """A stage that finished in an earlier run: its saved model into the trainer and the sampler."""
        self.log(f"{path.name.removesuffix('_model')}: done in an earlier run; loading {path}")
        load_model(self.model, path)
        asyncio.run(self.policy.sync_weights(self.model, version))


class RLStage:
    """A method's RL stage. The base is what most methods share: nothing to add to the held-out evaluations,
    nothing to close, no settings it cannot run with."""

    def __init__(self, setup: Setup):
        self.setup = setup

    @staticmethod
    def check(job: TrainJob) -> None:
        """Settings of the rest of the job this method cannot run with: a `ValueError` that says the fix."""

    @staticmethod
    def preflight(job: TrainJob) -> None:
        """What the method needs on disk, checked when the job starts, before any model loads or server starts (not
        when the recipe loads: a recipe may name the output of a run not made yet). A `ValueError` with the fix."""

    def trains(self) -> bool:
        """Whether there is anything to run (an RL loop of 0 steps has not)."""
        return self.setup.job.rl.steps > 0

    def train(self) -> dict[str, Any]:
        """Runs (or resumes) the stage; returns what the run's summary keeps of it."""
        raise NotImplementedError

    def heldout(self, trajectories: list[Trajectory], label: str) -> dict[str, Any]:
        """What the method adds to the held-out evaluation `label`, given its episodes."""
        return {}

    def close(self) -> None:
        """Release what the stage started (a second engine, ...)."""


def run_loop(setup: Setup, cfg: LoopConfig, train: Callable[..., list[dict]], name: str,
             policy: Policy | None = None, note: str = "") -> None:
    """An RL loop method's stage: `train` (`grpo.train`, `ppo.train`) with the job's progress lines, its periodic
    held-out evaluations (`eval.every`), its agent engines and Ray sources; sampling from `policy` (default the
    job's)."""
    job, log = setup.job, setup.log
    fix = cfg.correction
    corrected = ", ".join(f"{kind} ({level})" for kind, level in (("TIS", fix.tis), ("MIS", fix.mis)) if level)
    log(f"{name}: {cfg.steps} steps × {cfg.tasks_per_step} tasks × {cfg.group_size}{note}" +
        (f"; sampler/trainer correction: decoupled{', ' + corrected if corrected else ''}" if fix.decoupled else ""))

    def periodic_eval(step: int, execute: Callable[[Coroutine], Any]) -> dict[str, Any]:
        due = job.eval and job.eval.every and step % job.eval.every == 0 and step < cfg.steps
        return setup.heldout(f"at step {step}", execute)[0] if due else {}

    train(cfg, setup.model, setup.tokenizer, policy or setup.policy, setup.make_env, setup.tasks, setup.out,
          on_step=lambda step, m: log(progress_line(step, cfg.steps, m)), periodic_eval=periodic_eval,
          engines=setup.engines, sources=job.ray.sources if job.ray else 0)
