"""Success at attempt k: pass@k's sequential cousin, with and without memory across attempts.

Each held-out task gets up to k attempts, one after another; a task counts as solved at attempt i when its i-th
attempt succeeds (full reward), and is not attempted again. success@i is the fraction of tasks solved within i
attempts. Two conditions per model:
- `plain`: the env as it is; attempts differ only in their sampling seeds (with a temperature, this is pass@k
  played in order);
- `memory`: the env wrapped in `ReflexionEnv` with a store of its own: after each failed attempt the policy writes
  a note, and the next attempt at that task opens with its notes.
Attempt i of a task draws the same seeds in every condition, so the conditions differ by the notes alone. An
attempt that ends in `error` counts as failed (and is counted).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from agentrl.env.memory import NoteStore, ReflexionEnv
from agentrl.env.registry import make
from agentrl.policy.protocol import Policy
from agentrl.renderer import Renderer
from agentrl.rollout.engine import RolloutConfig, RolloutEngine
from agentrl.rollout.jsonl import write_jsonl
from agentrl.types import Status, Task

CONDITIONS = ("plain", "memory")


def run_attempts(env: str, env_kwargs: dict[str, Any], split: str, tasks: list[Task], k: int, policy: Policy,
                 renderer: Renderer, rollout: RolloutConfig, memory: bool, max_notes: int = 3,
                 on_episode: Callable[[], None] | None = None, trajectories: Path | None = None) -> dict[str, Any]:
    """Up to `k` attempts at each of `tasks` (see the module's docstring); returns `success_at` (k rates),
    `solved_at` (task id -> attempt), `attempts`, `errors` (with the commonest `error_reasons`) and, with memory,
    `notes` (how many were written). Every attempt's trajectory, its number in `info["attempt"]`, goes to the JSONL
    file `trajectories` when given."""
    store = NoteStore(max_notes) if memory else None

    def make_env():
        return (ReflexionEnv(env, env_kwargs, split=split, store=store, max_notes=max_notes) if memory
                else make(env, split=split, **env_kwargs))

    probe = make(env, split=split, **env_kwargs)
    max_reward = probe.max_reward
    probe.close()
    position = {t.id: i for i, t in enumerate(tasks)}
    solved_at: dict[str, int] = {}
    attempts, errors, played = 0, Counter(), []
    for attempt in range(1, k + 1):
        todo = [t for t in tasks if t.id not in solved_at]
        if not todo:
            break
        with RolloutEngine(make_env, policy, renderer,
                           replace(rollout, group_size=1, seed=rollout.seed * 1_000 + attempt)) as engine:
            # seeded by each task's place in the whole list: attempt i draws the same seeds in every condition
            groups = asyncio.run(engine.run(todo, on_episode=on_episode and (lambda t: on_episode()),
                                            positions=[position[t.id] for t in todo]))
        for task, t in ((g.task, g.trajectories[0]) for g in groups):
            t.logs["attempt"] = attempt
            played.append(t)
            attempts += 1
            if t.status is Status.ERROR:
                errors[t.reason.splitlines()[0][:200] if t.reason else "?"] += 1
            if t.status is not Status.ERROR and t.reward >= max_reward - 1e-9:
                solved_at[task.id] = attempt
    if trajectories is not None:
        trajectories.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(played, trajectories)
    success_at = [sum(a <= i for a in solved_at.values()) / len(tasks) for i in range(1, k + 1)]
    out = {"success_at": success_at, "solved_at": solved_at, "attempts": attempts, "errors": sum(errors.values()),
           "error_reasons": dict(errors.most_common(5)), "tasks": len(tasks)}
    return {**out, "notes": len(store)} if store is not None else out


def write_attempts(out_dir: Path, runs: dict[str, dict[str, Any]], meta: dict[str, Any]) -> tuple[Path, Path]:
    """OUT/attempts.json (the runs by label, `meta`), OUT/attempts.md with the success@attempt-k table and
    OUT/attempts.png with the curves."""
    from agentrl.eval.report import png_bytes, pyplot

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "attempts.json").write_text(json.dumps({**meta, "runs": runs}, indent=2))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for label, run in runs.items():
        ks = range(1, len(run["success_at"]) + 1)
        ax.plot(ks, run["success_at"], marker="o", linestyle="--" if label.endswith("plain") else "-", label=label)
    ax.set_xlabel("attempt k")
    ax.set_ylabel("success within k attempts")
    ax.set_xticks(range(1, meta["k"] + 1))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    (out_dir / "attempts.png").write_bytes(png_bytes(fig))
    header = "| run | " + " | ".join(f"success@{i}" for i in range(1, meta["k"] + 1)) + " | notes | errors |"
    rows = [f"| {label} | " + " | ".join(f"{r:.3f}" for r in run["success_at"]) + f" | {run.get('notes', '-')} | "
            f"{run['errors']} |" for label, run in runs.items()]
    md = out_dir / "attempts.md"
    md.write_text("\n".join([
        f"# Success at attempt k: {meta['env']} ({meta['split']}, {meta['tasks']} tasks)", "",
        "A task is solved at attempt i when its i-th attempt succeeds; `memory` attempts open with the notes the "
        "policy wrote after its failed attempts at the same task (agentrl/env/memory.py), `plain` ones do not. "
        f"Sampling: temperature {meta['temperature']}, the same seeds per attempt in every run.", "",
        header, "|---|" + "--:|" * (meta["k"] + 2), *rows, "",
        *(f"- {label}: {n} attempts ended in error: {reason}" for label, run in runs.items()
          for reason, n in run.get("error_reasons", {}).items()), "", "![success at attempt k](attempts.png)", ""]))
    return md, out_dir / "attempts.png"
