"""A training run's held-out evaluations: each split of the job's env an entry of one suite, run by `run_suite` as
`agentrl eval` runs suites, and what the run's summary keeps of it (the counts behind each rate)."""

from __future__ import annotations

import asyncio
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Coroutine

from agentrl.env.api import TextEnv
from agentrl.env.suites import Suite, SuiteEntry
from agentrl.eval.run import EvalRunMismatch, run_suite
from agentrl.policy.protocol import Policy
from agentrl.renderer import Renderer
from agentrl.rollout.engine import Engines, EnvEngines
from agentrl.rollout.jsonl import read_jsonl
from agentrl.trainers.job.recipe import TrainJob
from agentrl.types import Trajectory


def evaluate_heldout(job: TrainJob, policy: Policy, renderer: Renderer, make_env: Callable[..., TextEnv],
            log: Callable[[str], None], label: str, engines: Engines | None = None,
            execute: Callable[[Coroutine], Any] = asyncio.run,
            weights: str | None = None) -> tuple[dict[str, Any], list[Trajectory]]:
    """(metrics, trajectories) of the held-out evaluation `label`: each split of the job's env an entry of one suite,
    run by `run_suite` as `agentrl eval` runs suites (the env's episodes in the job's envs, or `engines`' agent
    runs), into OUT/heldout/LABEL (run.json, trajectories.jsonl, results.json). The metrics are pooled over the
    splits, with the counts behind each rate, and per split under `suites` when there are several. `execute`
    runs the episodes' coroutine (`run_suite`'s). `weights` names the weights evaluated when a resumed run has
    them again as they were (the model before RL, the final model after N steps): an evaluation of the same weights
    that was interrupted resumes where it stopped; another label's, other weights' or None (weights a resumed run
    trains again) start over."""
    splits = [job.eval.split] if isinstance(job.eval.split, str) else job.eval.split
    suite = Suite(f"{job.env} held-out", entries=tuple(SuiteEntry(job.env, split, job.eval.n, job.env_kwargs)
                                                      for split in splits))
    out = Path(os.path.expanduser(job.out_dir)) / "heldout" / label.replace(" ", "_")
    model = job.model if weights is None else f"{job.model} ({weights})"  # run.json's: what a resume must match

    def evaluate() -> dict[str, Any]:
        return run_suite(suite, policy, renderer, out, model, config=replace(job.eval.rollout, group_size=1),
                         engines=lambda entry: engines or EnvEngines(lambda: make_env(entry.split)), execute=execute)

    if weights is None:
        shutil.rmtree(out, ignore_errors=True)
    try:
        results = evaluate()
    except EvalRunMismatch:  # raised before any episode: the folder holds an evaluation of other weights
        shutil.rmtree(out)
        results = evaluate()
    suites = {entry.split: heldout_metrics(results["entries"][entry.name]) for entry in suite.entries}
    for split, m in suites.items():
        errors = f", {m['errors']} episodes ended in error (not counted)" if m["errors"] else ""
        log(f"held-out ({split}, {m['episodes']} tasks) {label}: success {m['success']:.3f}, "
            f"mean reward {m['mean_reward']:.3f}{errors}")
    trajectories = read_jsonl(out / "trajectories.jsonl")
    metrics = heldout_metrics(results["all"])
    return (metrics if len(suites) == 1 else {**metrics, "suites": suites}), trajectories


def heldout_metrics(entry: dict[str, Any]) -> dict[str, Any]:
    """What a training run's summary keeps of `run_suite`'s results for one entry (or all pooled): success and
    mean reward over the non-error episodes, with their counts (`agentrl compare` tests on them)."""
    return {"success": entry["success"]["rate"], "successes": entry["success"]["successes"],
            "valid": entry["valid"], "episodes": entry["episodes"], "errors": entry["errors"]["count"],
            "truncated": entry["truncated"]["count"], "mean_reward": entry["reward"]["mean"],
            "mean_turns": entry["mean_turns"]}
