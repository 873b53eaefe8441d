"""The gateway with the official `openai` client against a running server: for every session, each trajectory is
prompt ids + the engine's sampled ids + the template's deltas, the mask is 1 exactly on sampled ids, tool calls
round-trip, and a history that diverges starts a new segment instead of being re-tokenized."""

from __future__ import annotations

import asyncio
import copy
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn
from transformers import AutoModelForCausalLM

import agentrl.gateway.sessions as gateway_sessions
from agentrl.gateway import Gateway, GatewayConfig, create_app
from agentrl.gateway.app import MAX_BODY_BYTES
from agentrl.policy.protocol import Sample, SamplingParams
from agentrl.renderer import Renderer
from agentrl.system import http_limits
from agentrl.system.tcp import listening_socket
from agentrl.types import Message, Trajectory

CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                         "parameters": {"type": "object",
                                                        "properties": {"expression": {"type": "string"}},
                                                        "required": ["expression"]}}}
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
TEMPLATES = Path(__file__).parent / "data" / "chat_templates"


class QueuePolicy:
    """Replies with the next text of `texts` (its canonical ids + the turn end), logprob -0.5 per token, and keeps
    every (prompt ids, sampled ids) it was called with."""

    weight_version = 3

    def __init__(self, renderer: Renderer, texts: list[str]):
        self.r, self.texts, self.calls = renderer, list(texts), []

    async def generate(self, prompt_ids, sampling: SamplingParams) -> list[Sample]:
        await asyncio.sleep(0.01)
        out = []
        for _ in range(sampling.n):
            ids = tuple(self.r.encode(self.texts.pop(0)) + [self.r.stop_token_ids[0]])[:sampling.max_tokens]
            self.calls.append((tuple(prompt_ids), ids))
            out.append(Sample(ids, (-0.5,) * len(ids), "stop"))
        return out

    async def sync_weights(self, model, version):
        raise TypeError("no weights")

    async def close(self):
        pass


class Server:
    """The app under uvicorn in a thread, on a free port."""

    def __init__(self, gateway: Gateway):
        self.gateway, sock = gateway, listening_socket()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(gateway), log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def session(self, **body) -> tuple[str, openai.OpenAI]:
        opened = httpx.post(f"{self.url}/sessions", json=body).json()
        return opened["id"], openai.OpenAI(base_url=opened["base_url"], api_key="none", max_retries=0)

    def reward(self, sid: str, reward: float) -> list[Trajectory]:
        assert httpx.post(f"{self.url}/sessions/{sid}/reward", json={"reward": reward}).status_code == 200
        state = httpx.get(f"{self.url}/sessions/{sid}").json()
        return [Trajectory.from_dict(t) for t in state["trajectories"]]

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


def serve(renderer: Renderer, texts: list[str], **config) -> tuple[Server, QueuePolicy]:
    policy = QueuePolicy(renderer, texts)
    return Server(Gateway(policy, renderer, GatewayConfig(**config))), policy


def assert_exact(trajectory: Trajectory, calls: list[tuple[tuple, tuple]]) -> None:
    """Each call's prompt is the trajectory up to the turn it sampled, the turn is its sampled ids verbatim, and the
    mask is 1 exactly there."""
    assert len(trajectory.turns) == len(calls)
    ids, mask = list(trajectory.token_ids), [0] * len(trajectory.token_ids)
    for turn, (prompt, sampled) in zip(trajectory.turns, calls):
        assert tuple(ids[:turn.start]) == prompt and tuple(ids[turn.start:turn.end]) == sampled
        mask[turn.start:turn.end] = [1] * len(sampled)
        assert trajectory.logprobs[turn.start:turn.end] == (-0.5,) * len(sampled)
    assert list(trajectory.loss_mask) == mask and trajectory.prompt_len == trajectory.turns[0].start
    assert trajectory.turns[-1].end == len(ids)


@pytest.mark.parametrize("planned", ["on the loop", "in a thread"])
def test_tool_calls_round_trip_with_exact_tokens(renderer, planned, monkeypatch):
    if planned == "in a thread":  # as a long conversation is
        monkeypatch.setattr(gateway_sessions, "INLINE_PLAN_CHARS", 0)
    server, policy = serve(renderer, [f"Let me compute.\n{CALL}", "<answer>5</answer>"])
    try:
        sid, client = server.session(task_id="t1", group=2)
        messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "2+3?"}]
        first = client.chat.completions.create(model="m", messages=messages, tools=[CALC])
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me compute."
        call = choice.message.tool_calls[0]
        assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "2+3"}
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        second = client.chat.completions.create(model="m", messages=messages, tools=[CALC])
        assert second.choices[0].message.content == "<answer>5</answer>"
        assert second.usage.prompt_tokens == len(policy.calls[1][0])
        [trajectory] = server.reward(sid, 1.0)
    finally:
        server.stop()
    assert_exact(trajectory, policy.calls)
    first_messages = [Message("system", "You add numbers."), Message("user", "2+3?")]
    assert policy.calls[0][0] == tuple(renderer.prompt_ids(first_messages, [CALC]))  # the first prompt, rendered
    assert trajectory.reward == 1.0 and trajectory.turns[-1].reward == 1.0 and trajectory.task_id == "t1"
    assert trajectory.group == 2 and trajectory.weight_version == 3 and trajectory.session == sid
    assert "5" in renderer.decode(trajectory.token_ids[trajectory.turns[0].end:trajectory.turns[1].start])


def test_a_client_that_renumbers_tool_call_ids_stays_in_one_segment(renderer):
    """Frameworks rewrite tool-call ids (renumbered at every call here, calls and results alike): a sampled reply must
    not become re-tokenized context of a new segment because of it."""
    server, policy = serve(renderer, [f"Let me compute.\n{CALL}", f"Once more.\n{CALL}", "<answer>5</answer>"])
    try:
        sid, client = server.session()
        messages = [{"role": "user", "content": "2+3?"}]
        for call in range(3):
            reply = client.chat.completions.create(model="m", messages=messages, tools=[CALC]).choices[0].message
            messages += [reply.model_dump(exclude_none=True)]
            if reply.tool_calls:
                messages += [{"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "5"}]
            ids = iter(range(100))
            for m in messages:
                for c in m.get("tool_calls", []):
                    c["id"] = f"call_{call}_{next(ids)}"
                if m["role"] == "tool":  # the result names its call's new id
                    m["tool_call_id"] = f"call_{call}_{next(ids) - 1}"
        [trajectory] = server.reward(sid, 1.0)
    finally:
        server.stop()
    assert_exact(trajectory, policy.calls)


def test_a_diverging_history_starts_a_new_segment(renderer):
    texts = ["first reply", "sub-agent reply", "after an edit", "continues the first"]
    server, policy = serve(renderer, texts)
    try:
        sid, client = server.session()
        main = [{"role": "user", "content": "Plan the trip."}]
        reply = client.chat.completions.create(model="m", messages=main).choices[0].message.content
        # a sub-agent with its own prompt
        client.chat.completions.create(model="m", messages=[{"role": "system", "content": "You are a sub-agent."},
                                                            {"role": "user", "content": "Find flights."}])
        # an edited history: the first reply rewritten by the program
        client.chat.completions.create(model="m", messages=[*main, {"role": "assistant", "content": "EDITED"},
                                                            {"role": "user", "content": "go on"}])
        # the unedited history again: continues the first segment
        client.chat.completions.create(model="m", messages=[*main, {"role": "assistant", "content": reply},
                                                            {"role": "user", "content": "go on"}])
        trajectories = server.reward(sid, 0.5)
    finally:
        server.stop()
    assert [len(t.turns) for t in trajectories] == [2, 1, 1]
    assert_exact(trajectories[0], [policy.calls[0], policy.calls[3]])
    assert_exact(trajectories[1], [policy.calls[1]])
    assert_exact(trajectories[2], [policy.calls[2]])
    # the edited message is context the program wrote: rendered from its text, never trained
    assert "EDITED" in renderer.decode(trajectories[2].token_ids[:trajectories[2].prompt_len])
    assert {t.logs["segment"] for t in trajectories} == {0, 1, 2}


def test_an_agent_that_compacts_its_own_history_trains_its_summary_and_goes_on_in_a_new_segment(renderer):
    """As Claude Code and Codex compact: the program asks for a summary (sampled in the first segment, trained
    there), then goes on from [system, task, summary]: a new segment whose summary is context (mask 0), its later
    replies sampled and trained. Both carry the session's reward; GRPO counts them as one sample."""
    summary = "Found: the flight is AF12 at 9:40. Left: book the hotel."
    server, policy = serve(renderer, ["searching flights", summary, "booking the hotel"])
    try:
        sid, client = server.session()
        task = [{"role": "system", "content": "You plan trips."}, {"role": "user", "content": "Plan the trip."}]
        first = client.chat.completions.create(model="m", messages=task).choices[0].message.content
        history = [*task, {"role": "assistant", "content": first}, {"role": "user", "content": "Summarize."}]
        written = client.chat.completions.create(model="m", messages=history).choices[0].message.content
        compacted = [*task, {"role": "assistant", "content": written}, {"role": "user", "content": "Go on."}]
        client.chat.completions.create(model="m", messages=compacted)
        trajectories = server.reward(sid, 1.0)
    finally:
        server.stop()
    before, after = trajectories
    assert written == summary and [len(t.turns) for t in trajectories] == [2, 1]
    assert_exact(before, policy.calls[:2])  # the summary: exactly the sampled ids, mask 1, in the first segment
    assert_exact(after, policy.calls[2:])  # the new segment: its prompt (the summary in it) mask 0
    assert summary in renderer.decode(after.token_ids[:after.prompt_len])
    assert before.session == after.session and before.reward == after.reward == 1.0


def test_several_choices_fork_and_each_continues_its_own(renderer):
    server, policy = serve(renderer, ["A", "B", "after B"])
    try:
        sid, client = server.session()
        messages = [{"role": "user", "content": "Say a letter."}]
        first = client.chat.completions.create(model="m", messages=messages, n=2)
        assert [c.message.content for c in first.choices] == ["A", "B"]
        client.chat.completions.create(model="m", messages=[*messages, {"role": "assistant", "content": "B"},
                                                            {"role": "user", "content": "again"}])
        a, b = server.reward(sid, 1.0)
    finally:
        server.stop()
    assert_exact(a, [policy.calls[0]])
    assert_exact(b, [policy.calls[1], policy.calls[2]])


def test_retrying_an_earlier_turn_forks_without_training_the_copy_twice(renderer):
    server, policy = serve(renderer, ["one", "two", "two again"])
    try:
        sid, client = server.session()
        history = [{"role": "user", "content": "Count."}]
        one = client.chat.completions.create(model="m", messages=history).choices[0].message.content
        history += [{"role": "assistant", "content": one}, {"role": "user", "content": "next"}]
        client.chat.completions.create(model="m", messages=history)
        client.chat.completions.create(model="m", messages=history)  # the same call again: a retry
        first, retry = server.reward(sid, 1.0)
    finally:
        server.stop()
    assert_exact(first, policy.calls[:2])
    # the copy of "one" is the retry's prompt, mask 0: it is trained once, in the segment that sampled it
    assert retry.prompt_len == len(policy.calls[2][0]) and retry.logs["forked_from"] == 0
    assert retry.token_ids[:retry.prompt_len] == policy.calls[2][0] and retry.num_sampled == len(policy.calls[2][1])


def test_streamed_replies_carry_the_tool_calls(renderer):
    server, policy = serve(renderer, [CALL])
    try:
        sid, client = server.session()
        stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+3?"}],
                                                tools=[CALC], stream=True, stream_options={"include_usage": True})
        events = list(stream)
        [trajectory] = server.reward(sid, 1.0)
    finally:
        server.stop()
    calls = [c for e in events for ch in e.choices for c in ch.delta.tool_calls or ()]
    assert [c.function.name for c in calls] == ["calculator"]
    assert [ch.finish_reason for e in events for ch in e.choices if ch.finish_reason] == ["tool_calls"]
    assert events[-1].usage.completion_tokens == len(policy.calls[0][1])
    assert_exact(trajectory, policy.calls)


def test_a_malformed_tool_call_is_plain_content_with_the_error_recorded(renderer):
    broken = '<tool_call>\n{"name": "calculator", "arguments": {"expression": \n</tool_call>'
    server, _ = serve(renderer, [broken])
    try:
        sid, client = server.session()
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+3?"}],
                                               tools=[CALC])
        [trajectory] = server.reward(sid, 0.0)
    finally:
        server.stop()
    assert reply.choices[0].message.content == broken and not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "stop"
    assert "Invalid JSON" in trajectory.logs["parse_errors"][0]


def test_qwen3_template_that_strips_reasoning_keeps_every_sampled_token(renderer):
    """Qwen3's template drops earlier `<think>` blocks, and agents send back the reply without its reasoning: the
    sampled reasoning tokens stay in the trajectory verbatim, and the history still matches."""
    tok = copy.deepcopy(renderer.tokenizer)
    tok.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = (TEMPLATES / "qwen3.jinja").read_text()
    qwen3 = Renderer(tok)
    server, policy = serve(qwen3, [f"<think>\nI should add.\n</think>\n\n{CALL}", "<think>\nDone.\n</think>\n\n5"],
                           reasoning=True)
    try:
        for sends_reasoning in (False, True):
            policy.texts = [f"<think>\nI should add.\n</think>\n\n{CALL}", "<think>\nDone.\n</think>\n\n5"]
            policy.calls.clear()
            sid, client = server.session()
            messages = [{"role": "user", "content": "2+3?"}]
            first = client.chat.completions.create(model="m", messages=messages, tools=[CALC]).choices[0]
            assert first.message.content is None and first.message.reasoning_content == "I should add."
            back = first.message.model_dump(exclude_none=True)
            if not sends_reasoning:
                back.pop("reasoning_content")
            messages += [back, {"role": "tool", "tool_call_id": first.message.tool_calls[0].id, "content": "5"}]
            second = client.chat.completions.create(model="m", messages=messages, tools=[CALC]).choices[0]
            assert second.message.content == "5"
            [trajectory] = server.reward(sid, 1.0)
            assert_exact(trajectory, policy.calls)
            assert "I should add." in qwen3.decode(trajectory.token_ids[trajectory.turns[0].start:
                                                                          trajectory.turns[0].end])
    finally:
        server.stop()


def test_bad_input_gets_a_4xx_and_loses_nothing(renderer):
    server, policy = serve(renderer, ["kept", "after"])
    try:
        sid, client = server.session()
        ok = [{"role": "user", "content": "hello"}]
        kept = client.chat.completions.create(model="m", messages=ok).choices[0].message.content
        chat = f"{server.url}/sessions/{sid}/v1/chat/completions"
        refused = {
            "malformed JSON": httpx.post(chat, content=b"{not json", headers={"content-type": "application/json"}),
            "unknown field": httpx.post(chat, json={"messages": ok, "temprature": 0.5}),
            "no messages": httpx.post(chat, json={"messages": []}),
            "forced tool": httpx.post(chat, json={"messages": ok, "tool_choice": "required"}),
            "json schema": httpx.post(chat, json={"messages": ok, "response_format": {"type": "json_object"}}),
            "image": httpx.post(chat, json={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            "unknown session": httpx.post(f"{server.url}/sessions/nope/v1/chat/completions", json={"messages": ok}),
            "oversized": httpx.post(chat, content=b" " * (MAX_BODY_BYTES + 1),
                                    headers={"content-type": "application/json"}),
            "seed past 64 bits": httpx.post(chat, json={"messages": ok, "seed": 2**64 + 5}),
            "lone surrogate": httpx.post(chat, content=b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
                                         headers={"content-type": "application/json"}),
            "tool without function": httpx.post(chat, json={"messages": ok, "tools": [{"type": "function"}]}),
            "a session id the client picks": httpx.post(f"{server.url}/sessions", json={"id": sid + "x"}),
            "more text than the context holds": httpx.post(chat, json={"messages": [{"role": "user", "content": "x" * (
                4096 * renderer.max_token_chars + 1)}]}),
            "tool without name": httpx.post(chat, json={"messages": ok, "tools": [{"type": "function",
                                                                                   "function": {"parameters": {}}}]}),
        }
        codes = {name: (r.status_code, r.json()["error"]["message"]) for name, r in refused.items()}
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            client.chat.completions.create(model="m", messages=ok, tool_choice="required")
        # a client that goes away mid-stream: the reply was recorded before the first chunk
        history = [*ok, {"role": "assistant", "content": kept}, {"role": "user", "content": "more"}]
        with httpx.stream("POST", chat, json={"messages": history, "stream": True}) as r:
            next(r.iter_lines())
        trajectories = server.reward(sid, 1.0)
        assert httpx.post(chat, json={"messages": ok}).status_code == 409  # closed
    finally:
        server.stop()
    assert {name: code for name, (code, _) in codes.items()} == {
        "malformed JSON": 400, "unknown field": 400, "no messages": 400, "forced tool": 400, "json schema": 400,
        "image": 400, "unknown session": 404, "oversized": 413, "seed past 64 bits": 400, "lone surrogate": 400,
        "tool without function": 400, "tool without name": 400, "a session id the client picks": 400,
        "more text than the context holds": 400}
    assert "characters, more than 4096 tokens can hold" in codes["more text than the context holds"][1]
    assert len(sid) == 32 and int(sid, 16) >= 0  # random, 128 bits: another client cannot guess it
    assert "temprature" in codes["unknown field"][1] and "POST /sessions" in codes["unknown session"][1]
    assert "not valid UTF-8" in codes["lone surrogate"][1] and "tools[0] must be" in codes["tool without name"][1]
    [trajectory] = trajectories
    assert_exact(trajectory, policy.calls)


def test_bodies_that_never_arrive_get_408_and_free_their_connections(renderer, monkeypatch):
    """A client that sends its headers and withholds the body (300 such connections were all still held after 62 s)."""
    monkeypatch.setattr(http_limits, "BODY_TIMEOUT_S", 0.5)
    server, _ = serve(renderer, [])
    try:
        port = int(server.url.rsplit(":", 1)[1])
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
        for sock in held:
            sock.sendall(b"POST /sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"task")
        for sock in held:
            sock.settimeout(10)
            reply = b""
            while chunk := sock.recv(4096):  # to the end: the server closes the connection
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.5 s" in reply
            sock.close()
        assert httpx.post(f"{server.url}/sessions", json={}).status_code == 200  # whole bodies are read as before
    finally:
        server.stop()


def test_sessions_do_not_mix(renderer):
    """32 concurrent sessions, each two calls: every trajectory holds its own session's calls only."""
    n = 32
    policy = QueuePolicy(renderer, [])
    policy.texts = None  # replies are derived from the prompt below

    async def generate(prompt_ids, sampling):
        await asyncio.sleep(0.005)
        text = renderer.decode(prompt_ids)
        name = text.split("I am ")[1].split("<")[0].strip()
        ids = tuple(renderer.encode(f"{name} turn {text.count('assistant')}") + [renderer.stop_token_ids[0]])
        policy.calls.append((tuple(prompt_ids), ids))
        return [Sample(ids, (-0.5,) * len(ids), "stop")]

    policy.generate = generate
    server = Server(Gateway(policy, renderer))

    async def agent(i: int) -> tuple[str, str]:
        opened = httpx.post(f"{server.url}/sessions", json={"task_id": f"task{i}"}).json()
        client = openai.AsyncOpenAI(base_url=opened["base_url"], api_key="none", max_retries=0)
        messages = [{"role": "user", "content": f"I am agent{i}"}]
        first = (await client.chat.completions.create(model="m", messages=messages)).choices[0].message.content
        messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "again"}]
        await client.chat.completions.create(model="m", messages=messages)
        return opened["id"], f"agent{i}"

    async def main():
        return await asyncio.gather(*(agent(i) for i in range(n)))

    try:
        ids = asyncio.run(main())
        results = {name: server.reward(sid, 1.0) for sid, name in ids}
    finally:
        server.stop()
    by_prompt = {p: s for p, s in policy.calls}
    for name, [trajectory] in results.items():
        calls = [(tuple(trajectory.token_ids[:t.start]), tuple(trajectory.token_ids[t.start:t.end]))
                 for t in trajectory.turns]
        assert len(calls) == 2 and all(by_prompt[p] == s for p, s in calls)
        assert renderer.decode(trajectory.token_ids).count(name) == 3 and trajectory.task_id == name.replace(
            "agent", "task")


class Recording:
    """A real policy, its calls kept: (prompt ids, sampled ids) and the sampled logprobs."""

    def __init__(self, policy):
        self.policy, self.calls, self.logprobs = policy, [], []
        self.weight_version = 0

    async def generate(self, prompt_ids, sampling):
        samples = await self.policy.generate(prompt_ids, sampling)
        for s in samples:
            self.calls.append((tuple(prompt_ids), s.token_ids))
            self.logprobs.append(s.logprobs)
        return samples

    async def sync_weights(self, model, version):
        await self.policy.sync_weights(model, version)

    async def close(self):
        await self.policy.close()


def test_a_real_policy_through_the_gateway_keeps_its_sampled_tokens(renderer, tiny_model_dir):
    """A real engine's samples through the official client: the trajectory holds them verbatim, and the trainer's
    logprobs of each turn in the trajectory's context equal the engine's: the context is the one it sampled from."""
    from agentrl.policy.hf import HFPolicy

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    keeps_its_sampled_tokens(HFPolicy(model, renderer.tokenizer), model, renderer)


@pytest.mark.vllm
def test_vllm_through_the_gateway_keeps_its_sampled_tokens(vllm_server, renderer, tiny_model_dir):
    from agentrl.policy.vllm_client import VLLMPolicy

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    keeps_its_sampled_tokens(VLLMPolicy.attach(vllm_server.url), model, renderer)


def keeps_its_sampled_tokens(inner, model, renderer) -> None:
    from agentrl.policy.parity import trainer_logprobs

    policy = Recording(inner)
    server = Server(Gateway(policy, renderer, GatewayConfig(max_tokens=24)))
    try:
        sid, client = server.session()
        messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "2+3?"}]
        for turn in range(3):
            reply = client.chat.completions.create(model="m", messages=messages, tools=[CALC], seed=turn,
                                                   logprobs=True)
            message = reply.choices[0].message
            assert [t.logprob for t in reply.choices[0].logprobs.content] == pytest.approx(policy.logprobs[-1])
            messages.append(message.model_dump(exclude_none=True))
            messages += ([{"role": "tool", "tool_call_id": c.id, "content": "5"} for c in message.tool_calls]
                         if message.tool_calls else [{"role": "user", "content": "Check it again."}])
        [trajectory] = server.reward(sid, 1.0)
    finally:
        server.stop()
        asyncio.run(policy.close())
    assert len(trajectory.turns) == 3
    for turn, (prompt, sampled), logprobs in zip(trajectory.turns, policy.calls, policy.logprobs):
        assert tuple(trajectory.token_ids[:turn.start]) == prompt and trajectory.token_ids[turn.start:turn.end] == \
            sampled and trajectory.logprobs[turn.start:turn.end] == logprobs
        expected = trainer_logprobs(model, prompt, sampled)
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-3, rtol=0)
    assert sum(trajectory.loss_mask) == sum(t.end - t.start for t in trajectory.turns)


def test_a_stop_string_is_cut_from_the_content_and_kept_in_the_ids(renderer):
    server, policy = serve(renderer, ["Thought: add\nObservation:", "done"])
    try:
        sid, client = server.session()
        history = [{"role": "user", "content": "2+3?"}]
        first = client.chat.completions.create(model="m", messages=history, stop=["Observation:"])
        assert first.choices[0].message.content == "Thought: add\n"  # as OpenAI returns it
        history += [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "Observation: 5"}]
        client.chat.completions.create(model="m", messages=history)
        [trajectory] = server.reward(sid, 1.0)
        taken = httpx.delete(f"{server.url}/sessions/{sid}").json()["trajectories"]
        assert httpx.get(f"{server.url}/sessions/{sid}").status_code == 404  # taken: forgotten
    finally:
        server.stop()
    assert_exact(trajectory, policy.calls)  # one segment: the history matched with the stop string cut
    assert "Observation:" in renderer.decode(trajectory.token_ids[trajectory.turns[0].start:trajectory.turns[0].end])
    assert [Trajectory.from_dict(t) for t in taken] == [trajectory]


class SeedQueue(QueuePolicy):
    """`QueuePolicy`, keeping the sampling seed of every call."""

    def __init__(self, renderer: Renderer, texts: list[str]):
        super().__init__(renderer, texts)
        self.seeds: list[int | None] = []

    async def generate(self, prompt_ids, sampling: SamplingParams) -> list[Sample]:
        self.seeds.append(sampling.seed)
        return await super().generate(prompt_ids, sampling)


def test_a_seeded_sessions_calls_draw_the_seeds_earlier_runs_did(renderer):
    """Calls 1 and 2 of a session seeded 7, as numbers (a changed formula would sample other runs than earlier
    ones did); a request that names its own seed keeps it, and an unseeded session sets none."""
    policy = SeedQueue(renderer, ["a", "b", "c", "d"])
    gateway = Gateway(policy, renderer)
    seeded, unseeded = gateway.open("t", seed=7), gateway.open("u")
    history = [Message("user", "hi")]
    for sid, sampling in ((seeded.id, SamplingParams()), (seeded.id, SamplingParams()),
                          (seeded.id, SamplingParams(seed=42)), (unseeded.id, SamplingParams())):
        asyncio.run(gateway.complete(sid, history, None, sampling))
    assert policy.seeds == [7_000_022, 7_000_023, 42, None]


def test_idle_sessions_close_as_errors_and_closed_ones_are_forgotten(renderer):
    gateway = Gateway(QueuePolicy(renderer, ["a"]), renderer, GatewayConfig(session_timeout=0.05))
    session = gateway.open("t")
    asyncio.run(gateway.complete(session.id, [Message("user", "hi")], None, SamplingParams()))
    time.sleep(0.1)
    gateway.open("other")  # each open expires what is due
    [trajectory] = session.trajectories
    assert trajectory.status.value == "error" and "session_timeout" in trajectory.reason
    time.sleep(0.1)
    gateway.open("third")
    assert session.id not in gateway.sessions


def test_serve_gateway_refuses_settings_that_cannot_work(tiny_model_dir):
    from typer.testing import CliRunner

    from agentrl.cli.main import app

    runner = CliRunner()
    for args, message in [(["--tool-parser", "nope"], "tool_parser must be one of"),
                          (["--max-tokens", "5000"], "below max_total_tokens"),
                          (["--chat-template", "chatml-tool"], "chatml-tool")]:
        result = runner.invoke(app, ["serve", "gateway", "--model", str(tiny_model_dir), *args])
        assert result.exit_code == 2 and message in result.output, (args, result.output)


def test_in_process_servers_turn_nagle_off_on_their_connections():
    """An agent program calls the gateway from the gateway's own event loop (`AgentEngine`): with Nagle on, every
    reply written as headers then body waited ~40 ms for the client's delayed ACK. asyncio sets TCP_NODELAY only on
    sockets of protocol IPPROTO_TCP, which a plain `socket.socket()` is not (the control, so that this can fail)."""

    async def nodelay_of_accepted(sock: socket.socket) -> int:
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()

        def handle(reader, writer):
            accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handle, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname())
        try:
            return await asyncio.wait_for(accepted, 10)
        finally:
            writer.close()
            server.close()

    plain = socket.socket()
    plain.bind(("127.0.0.1", 0))
    assert asyncio.run(nodelay_of_accepted(plain)) == 0
    assert asyncio.run(nodelay_of_accepted(listening_socket())) != 0
