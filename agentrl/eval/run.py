"""Evaluation: a policy on a suite into a run directory (`run_suite`): `agentrl eval`, and the held-out evaluations
of `agentrl train` (each split of the job's env an entry of its suite, the episodes its engines').

A success is an episode whose `outcome` reward component is 1 (or, for envs without one, whose reward
reaches the env's maximum). Errors are counted, never scored as failures.

`run_suite` writes RUN_DIR/run.json (what was asked), trajectories.jsonl (one line per episode, appended as
each finishes) and results.json (`eval_metrics.summarize_run`). It is resumable: run again with the same
arguments and only the missing (entry, task, sample) episodes run. Every episode's seeds come from
(seed, entry, task, sample) alone, so a resumed run samples exactly what an uninterrupted one would.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Coroutine, Sequence

from agentrl.env.api import TextEnv
from agentrl.eval.metrics import is_success, summarize_run
from agentrl.policy.protocol import Policy
from agentrl.env.registry import make
from agentrl.renderer import Renderer
from agentrl.rollout import seeds
from agentrl.rollout.engine import Engines, EnvEngines, RolloutConfig
from agentrl.rollout.jsonl import JsonlWriter, read_records
from agentrl.env.suites import Suite, SuiteEntry
from agentrl.types import Task, Trajectory


class EvalRunMismatch(ValueError):
    """RUN_DIR holds an eval of another suite, model or settings: resuming into it would mix results."""


@dataclass(frozen=True)
class _Planned:
    entry: SuiteEntry
    task: Task
    sample: int
    env_seed: int
    sample_seed: int


def run_suite(suite: Suite, policy: Policy, renderer: Renderer, out_dir: str | Path, model: str | Path,
              ks: Sequence[int] = (1,), n_tasks: int | None = None, config: RolloutConfig = RolloutConfig(),
              on_episode: Callable[[Trajectory], None] | None = None,
              engines: Callable[[SuiteEntry], Engines] | None = None,
              execute: Callable[[Coroutine], Any] = asyncio.run) -> dict[str, Any]:
    """Evaluates `policy` on every entry of `suite` with max(ks) samples per task; returns results.json. Each
    entry's episodes are played by `engines(entry)` (default: its env in this process; `agentrl train` gives its
    Ray envs or its agent program), on the event loop `execute` runs them on (default: a new one; asynchronous training
    gives the one where its rollouts sample, since a policy's connections belong to one loop)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_samples = max(ks)
    entries = [replace(e, n_tasks=min(e.n_tasks, n_tasks or e.n_tasks)) for e in suite.entries]
    run = {"suite": suite.name, "version": suite.version, "model": str(model), "k": sorted(set(ks)), "n": n_samples,
           "seed": config.seed, "sampling": asdict(config.sampling),
           "entries": [{"name": e.name, "env": e.env, "split": e.split, "n_tasks": e.n_tasks,
                        "env_kwargs": e.env_kwargs} for e in entries]}
    run = json.loads(json.dumps(run))  # as it reads back from run.json (tuples become lists)
    run_path, log_path = out / "run.json", out / "trajectories.jsonl"
    previous = json.loads(run_path.read_text()) if run_path.exists() else None
    if previous is not None:
        asked = {k: v for k, v in previous.items() if k in run}
        if asked != run:
            changed = sorted(k for k in run if asked.get(k) != run[k])
            raise EvalRunMismatch(f"{out} holds an eval with other {', '.join(changed)}; "
                                  f"use a new output directory (or delete this one) to start over.")
        run = previous
    run.update(started=run.get("started") or time.strftime("%Y-%m-%dT%H:%M:%S"), finished=None)
    run_path.write_text(json.dumps(run, indent=2))

    done = _read_finished(log_path)
    envs = {e.name: make(e.env, split=e.split, **e.env_kwargs) for e in entries}
    engines = engines or (lambda e: EnvEngines(lambda: make(e.env, split=e.split, **e.env_kwargs)))
    factories = {e.name: engines(e) for e in entries}
    max_reward = {name: factory.max_reward for name, factory in factories.items()}
    todo = [ep for ep in _episodes(entries, envs, n_samples, config.seed)
            if (ep.entry.name, ep.task.id, ep.sample) not in done]
    start = time.perf_counter()
    with JsonlWriter(log_path, append=True) as log:
        def finished(ep: _Planned, t: Trajectory) -> None:
            env = envs[ep.entry.name]
            t = replace(t, metrics={**t.metrics, "success": is_success(t, max_reward[ep.entry.name])},
                        logs={**t.logs, "entry": ep.entry.name, "env": ep.entry.env, "split": ep.entry.split,
                              "sample": ep.sample, "difficulty": env.difficulty(ep.task)})
            log.write(t)
            done[(ep.entry.name, ep.task.id, ep.sample)] = t
            if on_episode:
                on_episode(t)

        execute(_run_episodes(todo, factories, policy, renderer, config, finished))
    trajectories = [done[k] for k in sorted(done)]
    results = summarize_run(trajectories, run["k"])
    (out / "results.json").write_text(json.dumps(results, indent=2))
    run.update(finished=time.strftime("%Y-%m-%dT%H:%M:%S"),
               seconds=round((run.get("seconds") or 0.0) + time.perf_counter() - start, 2))
    run_path.write_text(json.dumps(run, indent=2))
    return results


def _episodes(entries: Sequence[SuiteEntry], envs: dict[str, TextEnv], n_samples: int,
              seed: int) -> list[_Planned]:
    episodes = []
    for e_index, entry in enumerate(entries):
        tasks = list(envs[entry.name].tasks)[:entry.n_tasks]
        for t_index, task in enumerate(tasks):
            env_seed = seeds.eval_seed(seed, e_index, t_index)
            episodes += [_Planned(entry, task, k, env_seed, seeds.sample_seed(env_seed, n_samples, k))
                         for k in range(n_samples)]
    return episodes


async def _run_episodes(todo: Sequence[_Planned], factories: dict[str, Engines], policy: Policy,
                        renderer: Renderer, config: RolloutConfig,
                        finished: Callable[[_Planned, Trajectory], None]) -> None:
    engines = {name: factory(policy, renderer, config) for name, factory in factories.items()}
    gate = asyncio.Semaphore(config.concurrency)

    async def one(ep: _Planned) -> None:
        async with gate:
            t = await engines[ep.entry.name].run_episode(ep.task, ep.env_seed, ep.sample_seed, ep.sample)
        finished(ep, t)

    tasks = [asyncio.ensure_future(one(ep)) for ep in todo]
    try:
        await asyncio.gather(*tasks)
    finally:  # an interruption: nothing may still be in flight (and be recorded as failed) once the engines close
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for engine in engines.values():
            await engine.aclose()


def _read_finished(path: Path) -> dict[tuple[str, str, int], Trajectory]:
    """The episodes a previous (possibly killed) run finished; a last line cut short by the kill is cut off the
    file, so that appending continues on a clean line."""
    if not path.exists():
        return {}
    return {(t.logs["entry"], t.task_id, t.logs["sample"]): t
            for t in read_records(path, Trajectory.from_dict, repair=True)}
