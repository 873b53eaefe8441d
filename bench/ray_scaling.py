"""Episodes per second of the search env (`search/r1-v0`) with its envs in 1 and in 2 Ray worker actors, and
the overhead of Ray's dispatch against in-process envs at 1 worker, measured in the same run.

The policy is the env's scripted expert (gold searches and answers through the real renderer), so the
figures are those of the env side: BM25 searches, observation rendering, and for Ray the calls to the actor.
The issue sets no goal; `ratio` = episodes/s with 2 workers / with 1 (higher is better), and
`ray_overhead` = in-process episodes/s / 1-worker Ray episodes/s (lower is better).

    python bench/ray_scaling.py [--quick]

Starts (and stops) a local Ray cluster. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import agentrl
from agentrl.rollout.ray_pool import RayConfig, RayEnvPool, init_ray
from agentrl.renderer import Renderer
from agentrl.rollout.engine import RolloutConfig, RolloutEngine
from agentrl.policy.scripted import ScriptedPolicy, playing
from agentrl.models.tiny import build_tiny_model
from agentrl.models.tokenizer import load_tokenizer
from results import record  # bench/results.py: the last line, kept in bench/results/

ENV = "search/r1-v0"


def episodes_per_second(make_env, tasks, renderer, respond, check: bool = True) -> float:
    engine = RolloutEngine(make_env, ScriptedPolicy(renderer, respond, "<|im_start|>assistant"), renderer,
                           RolloutConfig(concurrency=32, max_total_tokens=4096))
    start = time.perf_counter()
    try:
        groups = asyncio.run(engine.run(tasks))
    finally:
        engine.close()
    failed = [t.reason for g in groups for t in g.trajectories if t.status.value != "ok"]
    if failed and check:
        sys.exit(f"{len(failed)} episodes did not end ok, e.g. {failed[:3]}")
    return len(tasks) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer episodes (well under a minute)")
    parser.add_argument("--model", default="~/.cache/agentrl/models/tiny", help="whose tokenizer renders")
    a = parser.parse_args()
    n = 64 if a.quick else 256
    renderer = Renderer(load_tokenizer(build_tiny_model(Path(a.model).expanduser(), quiet=True)))
    env = agentrl.make(ENV)
    tasks = list(env.tasks)[:n]
    respond = playing({t.data["question"]: env.gold_actions(t) for t in tasks})

    in_process = episodes_per_second(lambda: agentrl.make(ENV), tasks, renderer, respond)
    init_ray()
    rates = {}
    for workers in (1, 2):
        pool = RayEnvPool(ENV, {}, RayConfig(workers=workers))
        # warm-up: each worker opens the world and its index for its first episodes; not measured
        episodes_per_second(pool.make, tasks[:8], renderer, respond, check=False)
        rates[workers] = episodes_per_second(pool.make, tasks, renderer, respond)
        pool.close()
    ratio, overhead = rates[2] / rates[1], in_process / rates[1]
    print(f"{n} episodes of {ENV}: in-process {in_process:.1f}/s, Ray 1 worker {rates[1]:.1f}/s, "
          f"2 workers {rates[2]:.1f}/s", file=sys.stderr)
    record(__file__, {"ratio": round(ratio, 3), "goal": "none set (2 workers / 1, higher is better)",
                      "episodes_per_s": {"in_process": round(in_process, 2), "ray_1_worker": round(rates[1], 2),
                                         "ray_2_workers": round(rates[2], 2)},
                      "ray_overhead": round(overhead, 3)})


if __name__ == "__main__":
    main()
