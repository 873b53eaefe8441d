"""Segments: the exact token sequences of one agent session, matched against each request's messages.

An agent program sends the whole conversation as text at every call. The gateway never re-tokenizes what the
model sampled: it finds the segment whose history the request continues and appends only the template's delta.

    request k   = messages M_k (+ tools)
    match       = the segment with the longest run of turns whose messages are a prefix of M_k, where each
                  assistant message the gateway returned may come back as returned, with or without its
                  reasoning, or with the reasoning put back into the content (Qwen3-style templates strip it)
    extend      = the segment's ids + delta(M_k after that turn)             (loss mask 0)
    fork        = a match at an earlier turn, or at a turn another call is continuing: a new segment whose
                  prompt is a copy of the ids up to that turn (mask 0: they are trained in the segment that
                  sampled them) + the delta
    new         = no match (a sub-agent's own prompt, a compacted or edited history): render(M_k) from scratch
    then        + the sampled ids, verbatim                                  (loss mask 1)

Each segment becomes its own `Trajectory` when the session closes, linked to the session by `Trajectory.session`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

from agentrl.policy.protocol import Sample
from agentrl.renderer import Renderer
from agentrl.types import Message, StopReason, Trajectory, Turn

Key = tuple


def key(message: Message) -> Key:
    """What must be equal for two messages to be the same message of a history (tool-call ids aside: clients and
    frameworks rewrite them)."""
    calls = tuple((c.name, json.dumps(c.arguments, sort_keys=True)) for c in message.tool_calls)
    content = message.content.strip()
    if "</think>" in content:  # however the reasoning was spaced when it is put back
        thought, rest = content.split("</think>", 1)
        content = f"<think>{thought.removeprefix('<think>').strip()}</think>{rest.strip()}"
    return message.role, content, calls


def tools_key(tools: Sequence[dict] | None) -> str:
    """Requests with other tools render another system prompt: they never share a segment."""
    return json.dumps(tools, sort_keys=True)


@dataclass
class SampledTurn:
    """One sampled reply inside a segment: ids [start, end) sampled, [end, obs_end) the next delta."""

    start: int
    end: int
    finish_reason: str
    weight_version: int
    at: int  # how many of the segment's messages come before the reply
    obs_end: int = -1  # set when the next delta is appended (== end for the last turn)


@dataclass
class Segment:
    """The mutable builder of one trajectory of a session."""

    index: int
    tools: list[dict] | None
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)  # as the template sees them (replies with reasoning)
    accepts: list[frozenset[Key]] = field(default_factory=list)  # per message: the forms a request may send it in
    turns: list[SampledTurn] = field(default_factory=list)
    prompt_len: int = 0
    forked_from: int | None = None
    busy: bool = False  # a call is sampling its next turn

    def matches(self, turn: SampledTurn, request: Sequence[Message]) -> bool:
        """Whether `request` starts with this segment's messages up to and including `turn`'s reply (and goes on)."""
        return len(request) > turn.at + 1 and all(key(m) in self.accepts[i]
                                                  for i, m in enumerate(request[:turn.at + 1]))

    def continue_with(self, at: int, request: Sequence[Message]) -> None:
        """Keep the messages up to and including position `at`, then the request's from there on."""
        rest = list(request[at + 1:])
        self.messages = self.messages[:at + 1] + rest
        self.accepts = self.accepts[:at + 1] + [frozenset({key(m)}) for m in rest]

    def to_trajectory(self, session: str, task_id: str, group: int, reward: float, reason: str, stop: StopReason,
                      metrics: dict[str, float], logs: dict[str, Any]) -> Trajectory:
        """The segment as a trajectory: the session's reward on its last turn; the session's `metrics` and `logs`
        (the client's session info) with the segment's index."""
        last = len(self.turns) - 1
        turns = tuple(Turn(t.start, t.end, t.obs_end if t.obs_end >= 0 else t.end, reward if i == last else 0.0,
                           t.finish_reason, t.weight_version) for i, t in enumerate(self.turns))
        return Trajectory(
            task_id=task_id, token_ids=tuple(self.ids), loss_mask=tuple(self.mask), logprobs=tuple(self.logprobs),
            prompt_len=self.prompt_len, turns=turns, reward=reward, stop=stop, reason=reason,
            messages=tuple(self.messages), group=group, weight_version=min(t.weight_version for t in self.turns),
            session=session, metrics=metrics, logs={**logs, "segment": self.index, **(
                {"forked_from": self.forked_from} if self.forked_from is not None else {})})


@dataclass(frozen=True)
class Plan:
    """Where a request's sample goes: `segment` (None: a new one), continued after its turn `after` (None: from the
    start), with `prompt_ids` to sample from; `fork` when the ids up to that turn are copied into a new segment."""

    segment: Segment | None
    after: int | None
    fork: bool
    prompt_ids: list[int]
    delta: list[int]


def plan(segments: Sequence[Segment], request: Sequence[Message], tools: list[dict] | None,
         renderer: Renderer) -> Plan:
    """The segment and turn that `request` continues (the longest match, an idle segment's last turn first), and
    the ids to sample from. Renders only the delta after the matched turn, or the whole request when none matches."""
    best: tuple[int, bool, Segment, int] | None = None
    for seg in segments:
        if tools_key(seg.tools) != tools_key(tools):
            continue
        for j in range(len(seg.turns) - 1, -1, -1):
            if seg.matches(seg.turns[j], request):
                extend = j == len(seg.turns) - 1 and not seg.busy
                candidate = (seg.turns[j].at, extend, seg, j)
                if best is None or candidate[:2] > best[:2]:
                    best = candidate
                break
    if best is None:
        prompt = renderer.prompt_ids(request, tools)
        return Plan(None, None, False, prompt, prompt)
    _, extend, seg, j = best
    turn = seg.turns[j]
    delta = renderer.observation_ids(seg.messages[:turn.at], seg.messages[turn.at], request[turn.at + 1:],
                                     seg.ids[turn.start:turn.end], tools)
    return Plan(seg, j, not extend, seg.ids[:turn.end] + delta, delta)


def commit(plan: Plan, segments: list[Segment], request: Sequence[Message], tools: list[dict] | None,
           sample: Sample, reply: Message, accepted: frozenset[Key], version: int, fork: bool) -> Segment:
    """Appends `sample` where `plan` says (a new segment when it says fork, or when `fork` asks for one: the n-th
    choice of one request), and returns the segment."""
    seg = plan.segment
    if seg is None or plan.fork or fork:
        new = Segment(len(segments), tools, forked_from=seg.index if seg is not None else None)
        n = len(plan.prompt_ids)
        new.ids, new.mask, new.logprobs, new.prompt_len = list(plan.prompt_ids), [0] * n, [0.0] * n, n
        if seg is not None and plan.after is not None:
            new.messages, new.accepts = seg.messages, seg.accepts
        new.continue_with(seg.turns[plan.after].at if seg is not None and plan.after is not None else -1, request)
        segments.append(new)
        seg = new
    else:  # extend in place: the delta, then the reply
        seg.turns[-1].obs_end = len(seg.ids) + len(plan.delta)
        seg.ids += plan.delta
        seg.mask += [0] * len(plan.delta)
        seg.logprobs += [0.0] * len(plan.delta)
        seg.continue_with(seg.turns[-1].at, request)
    start = len(seg.ids)
    seg.ids += sample.token_ids
    seg.mask += list(sample.trainable) if sample.trainable else [1] * len(sample.token_ids)
    seg.logprobs += sample.logprobs
    seg.turns.append(SampledTurn(start, len(seg.ids), sample.finish_reason, version, len(seg.messages)))
    seg.messages.append(reply)
    seg.accepts.append(accepted)
    return seg
