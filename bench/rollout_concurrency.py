"""Episodes/s of the rollout engine with 32 concurrent episodes vs a sequential loop over the same
episodes (concurrency 1), both measured in this run with the transformers backend and the tiny model.

    python bench/rollout_concurrency.py [--quick]

Target (issue #2): ratio >= 4 on 2 cores. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from agentrl.envs.math import ArithmeticEnv
from agentrl.policy.hf import HFPolicy
from agentrl.policy.protocol import SamplingParams
from agentrl.renderer import Renderer
from agentrl.rollout.engine import RolloutConfig, RolloutEngine
from agentrl.models.tiny import build_tiny_model
from results import record  # bench/results.py: the last line, kept in bench/results/

MODEL_DIR = Path.home() / ".cache" / "agentrl" / "models" / "tiny"


def episodes_per_second(policy: HFPolicy, tasks, concurrency: int, max_tokens: int) -> tuple[float, int]:
    config = RolloutConfig(concurrency=concurrency, max_total_tokens=1024,
                           sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0))
    engine = RolloutEngine(lambda: ArithmeticEnv(n_tasks=len(tasks)), policy, Renderer(policy.tokenizer), config)
    start = time.perf_counter()
    groups = asyncio.run(engine.run(tasks))
    seconds = time.perf_counter() - start
    engine.close()
    tokens = sum(t.num_sampled for g in groups for t in g.trajectories)
    return len(tasks) / seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter episodes (under a minute)")
    args = parser.parse_args()
    n_episodes, max_tokens = (32, 24) if args.quick else (64, 64)

    policy = HFPolicy.load(build_tiny_model(MODEL_DIR, quiet=True))
    tasks = list(ArithmeticEnv(n_tasks=n_episodes).tasks)
    episodes_per_second(policy, tasks[:2], 2, 4)  # warm-up: first forward passes are slower
    sequential, tokens_seq = episodes_per_second(policy, tasks, 1, max_tokens)
    concurrent, tokens_con = episodes_per_second(policy, tasks, 32, max_tokens)
    record(__file__, {
        "ratio": round(concurrent / sequential, 2), "goal": ">= 4",
        "concurrent_episodes_per_s": round(concurrent, 3), "sequential_episodes_per_s": round(sequential, 3),
        "episodes": n_episodes, "max_tokens_per_turn": max_tokens,
        "sampled_tokens": {"sequential": tokens_seq, "concurrent": tokens_con},
    })


if __name__ == "__main__":
    main()
