"""Asynchronous against synchronous GRPO: trained tokens per second at `max_staleness` 0 (synchronous), 1 and 2,
measured in the same run on the same model, envs, batch and number of optimizer steps.

Each row runs GRPO (`agentrl.trainers.methods.grpo.train`) for the same steps from the same weights, with the in-process
engine on its own copy of the model, and reads the loop's own metrics: trained tokens (the sampled tokens of the
groups trained) over the steps' wall time, and the engine, env and trainer idle fractions of each step (mean over the
steps). Two envs:

1. `web/miniwob-v0` in a real Chromium (4 tasks x 4 episodes per step, 4 at once, up to 3 turns): page loads and
   Playwright actions wait, so the engine and trainer idle while a synchronous step waits for its slowest episode.
   Goal: asynchronous (max_staleness 1) >= 1.5x synchronous.
2. `math/arith-v0` (8 tasks x 8 episodes per step): compute-bound. On 2 cores the engine and the trainer compete for
   the same cores, so overlapping them gains little; its ratios are reported, with no goal.
3. `swe/generated-v0` (4 tasks x 4 episodes per step, 4 at once, 3 turns): each episode leases a Docker sandbox
   and uploads its repository (0.05-0.45 s), and when its turns run out it is graded as SWE-bench grades it: the
   hidden tests run in a fresh sandbox (1.0-1.3 s measured). The random model's turns are invalid tool calls,
   answered with corrective observations (`max_invalid = 4`, so that the episode reaches its grading). Needs
   Docker and the generated instances (`make setup-swe`).
4. An extra, labelled row, `math+latency`: the same math env with 1 s of injected latency in each reset and step (a
   remote tool or a sandbox start that only waits), and turns ended by half the vocabulary (as stop tokens), so that
   the random model's episodes take their 4 turns: 5 s of waiting per episode. Its episodes all wait at once: a
   step's 64, and at `max_staleness` k, k + 1 steps' (the next steps' episodes start while the last ones wait;
   with one step's, `max_staleness = 1` reached 1.29-1.30x in two runs, with two steps' 1.43-1.61x in four).

Each row also reports `cpu_busy`, the share of the machine's CPU time (all cores, every process: Chromium and
Docker included) that was busy while it trained. An asynchronous run does the same work as the synchronous one;
where all of it runs on these cores, it can be at most `1 / cpu_busy` of the synchronous row times faster
(`<env>_overlap_bound`): overlapping only fills cores that a synchronous step leaves idle, waiting. Each
asynchronous row's `<env>_k<k>_share_of_bound` is its ratio over that bound (issue 61's goal: >= 0.9 at k = 1).

The model is the tiny one (5 M parameters, random weights: it writes no valid tool call, so every episode runs to
its turn limit). Its rewards are fair coins (the `random` source), so that groups vary and the update trains them:
with the env's reward, 0 for every episode, the trainer skips every group and the bench would time rollouts alone.

    python bench/async_pipeline.py [--quick] [--envs web,swe,math,math+latency]

`--quick` (51 s): `math+latency` only, synchronous against max_staleness 1, 2 steps; that checks the bench runs,
but 2 steps mostly measure the asynchronous run's filling up (0.95x in one run), not its speed. The full run: every
env at max_staleness 0, 1 and 2, 6 steps each, after one untimed step of each env (sandbox pools, browsers and
caches warm up there, not in the first row; 14-29 minutes on 2 cores with AVX-512). The web
rows need Chromium and Playwright (`make setup-browser`). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from transformers import AutoModelForCausalLM

import agentrl
from agentrl.models.tiny import build_tiny_model
from agentrl.models.tokenizer import load_tokenizer
from agentrl.policy.hf import HFPolicy
from agentrl.policy.protocol import SamplingParams
from agentrl.rollout.engine import RolloutConfig
from agentrl.trainers.methods.grpo import GRPOConfig, train
from agentrl.trainers.rewards import RewardConfig
from results import record  # bench/results.py: the last line, kept in bench/results/

MODEL_DIR = Path("~/.cache/agentrl/models/tiny").expanduser()
ENVS = {  # env id, its kwargs, (tasks per step, group size, concurrency = env threads, max tokens per turn)
    "web": ("web/miniwob-v0", {"max_turns": 3, "max_sessions": 4}, (4, 4, 4, 48)),
    "swe": ("swe/generated-v0", {"max_turns": 3, "max_invalid": 4, "pool_size": 4}, (4, 4, 4, 48)),
    "math": ("math/arith-v0", {"max_turns": 4, "kinds": ["expression"], "max_ops": 2, "parser": "react"},
             (8, 8, 32, 64)),
}
ENVS["math+latency"] = (*ENVS["math"][:2], (8, 8, 64, 64))  # a step's episodes at once (see run_row)
LATENCY_S = 1.0  # math+latency: added to every reset and step


def with_latency(env):
    """`env` whose reset and step first wait `LATENCY_S` (in the env's thread, as a remote call would)."""
    reset, step = env.reset, env.step

    def slow_reset(**kwargs):
        time.sleep(LATENCY_S)
        return reset(**kwargs)

    def slow_step(action):
        time.sleep(LATENCY_S)
        return step(action)

    env.reset, env.step = slow_reset, slow_step
    return env


def cpu_jiffies() -> tuple[int, int]:
    """The machine's (busy, total) CPU time so far, over all cores and processes (Chromium, Docker included)."""
    user, nice, system, idle, iowait, *rest = map(int, Path("/proc/stat").read_text().split("\n")[0].split()[1:])
    total = user + nice + system + idle + iowait + sum(rest[:3])  # irq, softirq, steal (guest is inside user)
    return total - idle - iowait, total


def run_row(model_dir: Path, env_name: str, max_staleness: int, steps: int, out: Path) -> dict:
    """One training run; its trained tokens per second over the steps, mean idle fractions, and the share of the
    machine's CPU time that was busy while it ran."""
    env_id, env_kwargs, (tasks_per_step, group_size, concurrency, max_tokens) = ENVS[env_name]
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    slow = env_name.endswith("+latency")
    concurrency *= 1 + max_staleness if slow else 1  # every episode that the staleness bound lets start, waiting
    stops = tuple(range(0, len(tokenizer), 2)) if slow else ()
    cfg = GRPOConfig(steps=steps, tasks_per_step=tasks_per_step, lr=1e-4, minibatch_size=16, seed=0,
                     reward=RewardConfig(terms={"random": 1.0}),
                     max_staleness=max_staleness,
                     group_size=group_size, rollout=RolloutConfig(concurrency=concurrency, env_workers=concurrency,
                                           max_total_tokens=2048,
                                           sampling=SamplingParams(max_tokens=max_tokens, stop_token_ids=stops)))
    make_env = lambda: (with_latency if slow else lambda e: e)(agentrl.make(env_id, **env_kwargs))  # noqa: E731
    policy = HFPolicy(copy.deepcopy(model), tokenizer)  # the sampler's own copy, in every row alike
    tasks = list(make_env().tasks)
    busy0, total0 = cpu_jiffies()
    rows = train(cfg, model, tokenizer, policy, make_env, tasks, out)
    busy1, total1 = cpu_jiffies()
    seconds = sum(sum(r["time"].values()) for r in rows)
    tokens = sum(r["trained_tokens"] for r in rows)
    return {"env": env_name, "max_staleness": max_staleness, "trained_tokens": tokens, "seconds": round(seconds, 2),
            "trained_tokens_per_s": round(tokens / seconds, 1),
            "idle": {k: round(statistics.mean(r["idle"][k] for r in rows), 3) for k in rows[0]["idle"]},
            "stale_groups": sum(r.get("stale_groups", 0) for r in rows),
            "cpu_busy": round((busy1 - busy0) / (total1 - total0), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="math+latency, staleness 0 and 1, 2 steps")
    parser.add_argument("--envs", default="web,swe,math,math+latency", help="which rows to run (comma-separated)")
    a = parser.parse_args()
    model_dir = build_tiny_model(MODEL_DIR, quiet=True)
    envs = ["math+latency"] if a.quick else a.envs.split(",")
    plan = [(e, k) for e in envs for k in ((0, 1) if a.quick else (0, 1, 2))]
    steps, results = (2 if a.quick else 6), {}
    with tempfile.TemporaryDirectory(prefix="agentrl-async-bench-") as tmp:
        for env_name in [] if a.quick else envs:  # a step of each env first, not timed: sandbox pools, browsers
            run_row(model_dir, env_name, 0, 1, Path(tmp) / f"{env_name}-warmup")  # and caches warm up outside a row
        for env_name, k in plan:
            row = run_row(model_dir, env_name, k, steps, Path(tmp) / f"{env_name}-{k}")
            results[(env_name, k)] = row
            print(json.dumps(row), file=sys.stderr)
    def ratio(env: str, k: int) -> float:
        return round(results[(env, k)]["trained_tokens_per_s"] / results[(env, 0)]["trained_tokens_per_s"], 3)

    headline = "web" if "web" in envs else envs[0]
    figures = {"ratio": ratio(headline, 1), "goal": f">= 1.5 ({headline}, max_staleness 1 vs 0)", "steps": steps}
    for (env_name, k), row in results.items():
        figures[f"{env_name}_k{k}_tokens_per_s"] = row["trained_tokens_per_s"]
        figures[f"{env_name}_k{k}_idle"] = row["idle"]
        figures[f"{env_name}_k{k}_cpu_busy"] = row["cpu_busy"]
        if k:
            figures[f"{env_name}_k{k}_ratio"] = ratio(env_name, k)  # over the bound 1 / cpu_busy: goal >= 0.9
            synchronous_busy = results[(env_name, 0)]["cpu_busy"]
            figures[f"{env_name}_k{k}_share_of_bound"] = round(ratio(env_name, k) * synchronous_busy, 3)
        else:
            figures[f"{env_name}_overlap_bound"] = round(1 / row["cpu_busy"], 2)
    record(__file__, figures)


if __name__ == "__main__":
    main()
