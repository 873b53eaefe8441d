"""Sessions: one agent run each, its calls sampled by the policy and recorded as exact-token segments.

`Gateway` is the HTTP-free core that `agentrl.gateway.app` serves: `open` a session, `complete` its chat calls
(render the delta, sample, parse tool calls), then `close` it with a reward (or an error) into trajectories.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from pydantic import with_config

from agentrl.config import STRICT
from agentrl.gateway.segments import Key, Segment, commit, key, plan
from agentrl.policy.protocol import Policy, Sample, SamplingParams
from agentrl.renderer import Renderer, RendererError
from agentrl.rollout import seeds
from agentrl.rollout.timeline import Timeline
from agentrl.tools.parsers import PARSERS
from agentrl.types import Message, StopReason, ToolCall, Trajectory


# Up to this much message text a call is planned (matched, its delta rendered: ~0.4 ms) on the event loop; a thread
# hop cost ~30 ms a call with 32 sessions and the engine's decode thread on 2 cores. Longer ones go to a thread, so
# that rendering a long conversation whole (a new segment) does not hold the other sessions' calls.
INLINE_PLAN_CHARS = 64_000
# A program whose calls the gateway refuses this many times in a row floods it: it is not reading the errors, and
# would only stop at its timeout. Its session ends there, as an error.
FLOOD_REFUSALS = 16


@with_config(STRICT)
@dataclass(frozen=True)
class GatewayConfig:
    """How requests are sampled and parsed, and how long a session may live: `agentrl serve gateway`'s options (in
    training, `[agent]`'s and the rollout's settings make it)."""

    tool_parser: str = "hermes"  # a key of agentrl.tools.parsers.PARSERS: tool calls in the sampled text
    reasoning: bool = False  # split "<think>...</think>" off the reply into `reasoning_content` (Qwen3, R1)
    temperature: float = 1.0  # of a request that names none
    top_p: float = 1.0  # of a request that names none
    max_tokens: int = 512  # per call, when the request names none; a request may ask for fewer, not more
    max_total_tokens: int = 4096  # per segment: the prompt, every delta and every reply
    max_calls: int | None = None  # model calls per session (training: the rollout's max_turns); one more is refused
    # and ends the session as truncated (max_turns), as an env episode out of turns ends
    session_timeout: float = 900.0  # seconds without a call or a reward before an open session closes as error
    max_sessions: int = 4096  # open at once

    def __post_init__(self) -> None:
        if self.tool_parser not in PARSERS:
            raise ValueError(f"tool_parser must be one of {sorted(PARSERS)}, got {self.tool_parser!r}")
        if not 1 <= self.max_tokens < self.max_total_tokens:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be >= 1 and below max_total_tokens "
                             f"({self.max_total_tokens}), which also holds the prompt")
        if self.max_calls is not None and self.max_calls < 1:
            raise ValueError(f"max_calls must be >= 1 (or None: no limit), got {self.max_calls}")
        if not self.session_timeout > 0 or self.max_sessions < 1:
            raise ValueError("session_timeout must be > 0 seconds and max_sessions >= 1")


class GatewayError(Exception):
    """A request the gateway refuses: `status` is the HTTP code, the message says why and what to do."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.code = status, code


@dataclass(frozen=True)
class Reply:
    """One choice of a completion, as the client gets it."""

    content: str | None
    reasoning: str | None
    thought: str  # the sampled text of the reasoning, tags included ("" without reasoning)
    cut: str  # the stop string the reply ended on, cut from the content as OpenAI does ("" for none)
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str  # stop | length | tool_calls
    sample: Sample
    parse_error: str | None = None


@dataclass
class Session:
    """One agent run: its segments, and what closed it."""

    id: str
    task_id: str
    group: int
    info: dict[str, Any] = field(default_factory=dict)
    segments: list[Segment] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_active: float = field(default_factory=time.monotonic)
    calls: int = 0
    failed_calls: list[str] = field(default_factory=list)
    parse_errors: list[str] = field(default_factory=list)
    call_ids: itertools.count = field(default_factory=itertools.count)
    seed: int | None = None  # each call's sampling seed derives from it, unless the request names one
    overflow: str | None = None  # why a call was refused for the segment's max_total_tokens, if one was
    refused_in_a_row: int = 0  # calls refused since the last one answered (FLOOD_REFUSALS ends the session)
    trajectories: list[Trajectory] | None = None  # set when closed
    error: str | None = None  # why it closed as an error, if it did
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # set when closed, by the program or the gateway


class Gateway:
    """Sessions over one policy. Every method runs on the event loop that serves the app."""

    def __init__(self, policy: Policy, renderer: Renderer, config: GatewayConfig = GatewayConfig(),
                 timeline: Timeline | None = None):
        self.policy, self.renderer, self.config, self.timeline = policy, renderer, config, timeline or Timeline()
        self.sessions: dict[str, Session] = {}

    # ---- sessions ----
    def open(self, task_id: str = "", group: int = 0, info: dict[str, Any] | None = None,
             session_id: str | None = None, seed: int | None = None) -> Session:
        """A new session (its id a random one unless given); with `seed`, its calls sample reproducibly."""
        self.expire()
        if sum(s.trajectories is None for s in self.sessions.values()) >= self.config.max_sessions:
            raise GatewayError(429, f"{self.config.max_sessions} sessions are open (gateway.max_sessions): post "
                                    "rewards to close finished ones, or raise the limit", "rate_limit_exceeded")
        sid = session_id or uuid.uuid4().hex
        if sid in self.sessions:
            raise GatewayError(409, f"session {sid!r} exists already")
        session = self.sessions[sid] = Session(sid, task_id, group, dict(info or {}), seed=seed)
        return session

    def get(self, session_id: str) -> Session:
        """The session, open or closed; 404 if there is none by that id."""
        if (session := self.sessions.get(session_id)) is None:
            raise GatewayError(404, f"no session {session_id!r}: open one with POST /sessions (its response names "
                                    "the base_url to give the client)", "session_not_found")
        return session

    def close(self, session_id: str, reward: float | None = None, components: dict[str, float] | None = None,
              error: str | None = None, stop: StopReason | None = None) -> list[Trajectory]:
        """The session's segments as trajectories, each with `reward` (status error with `error` instead, or
        truncated when a call was refused for `max_total_tokens` before the error); a session closes once, and its
        trajectories stay until `pop`."""
        session = self.get(session_id)
        if session.trajectories is not None:
            raise GatewayError(409, f"session {session_id!r} is closed already")
        busy = [s.index for s in session.segments if s.busy]
        if error is None and busy:
            error = f"closed while calls were sampling (segments {busy}); post the reward after the last call returns"
        if error is None and reward is None:
            raise GatewayError(400, "a session closes with a reward or an error")
        session.last_active = time.monotonic()  # kept for `session_timeout` from now, for `pop`
        # an error is the program's side (it raised, timed out, never posted a reward), unless the caller says
        stop = (stop or StopReason.ENV_ERROR) if error else StopReason.TERMINATED
        if error and session.overflow:  # it failed once a call no longer fit: out of tokens, as an env episode past
            # max_total_tokens is, so truncated (reward 0, trained, in baselines), not an error left out of them
            stop, error = StopReason.MAX_TOTAL_TOKENS, f"{session.overflow}; then {error}"
        metrics = {"calls": session.calls, "failed_calls": len(session.failed_calls),
                   "parse_errors": len(session.parse_errors), "segments": len(session.segments)}
        logs = {**session.info, "failed_calls": session.failed_calls, "parse_errors": session.parse_errors}
        session.trajectories = [
            replace(seg.to_trajectory(session.id, session.task_id, session.group, 0.0 if error else reward,
                                      error or "", stop, metrics, logs), reward_components=dict(components or {}))
            for seg in session.segments if seg.turns]
        session.error = error
        session.closed.set()
        return session.trajectories

    def refused(self, session_id: str, why: str) -> None:
        """Count a refused call of an open session; the `FLOOD_REFUSALS`-th in a row ends it as an error."""
        session = self.sessions.get(session_id)
        if session is None or session.trajectories is not None:
            return
        session.refused_in_a_row += 1
        if session.refused_in_a_row >= FLOOD_REFUSALS:
            self.close(session_id, error=f"the agent program flooded the gateway: {session.refused_in_a_row} calls "
                                         f"refused in a row, the last: {why[:300]}")

    def pop(self, session_id: str) -> list[Trajectory]:
        """A closed session's trajectories, forgetting the session."""
        session = self.get(session_id)
        if session.trajectories is None:
            raise GatewayError(409, f"session {session_id!r} is still open")
        return self.sessions.pop(session_id).trajectories

    def expire(self) -> None:
        """Close, as errors, the open sessions idle for longer than `session_timeout`, and forget the closed ones
        that nobody took (`pop`) within it."""
        now, timeout = time.monotonic(), self.config.session_timeout
        for s in list(self.sessions.values()):
            if now - s.last_active <= timeout or any(seg.busy for seg in s.segments):
                continue
            if s.trajectories is None:
                self.close(s.id, error=f"no reward within session_timeout={timeout:g}s")
            else:
                del self.sessions[s.id]

    # ---- calls ----
    async def complete(self, session_id: str, messages: Sequence[Message], tools: list[dict] | None,
                       sampling: SamplingParams, parse_tools: bool = True) -> tuple[list[Reply], int]:
        """`sampling.n` replies to `messages` in the session, each recorded in its segment, and the prompt's length
        in tokens."""
        session = self.get(session_id)
        if session.trajectories is not None:
            raise GatewayError(409, f"session {session_id!r} is closed: open a new session for a new run")
        session.last_active, session.calls = time.monotonic(), session.calls + 1
        if self.config.max_calls is not None and session.calls > self.config.max_calls:
            reason = f"more than max_turns={self.config.max_calls} model calls in the session"
            self.close(session_id, error=reason, stop=StopReason.MAX_TURNS)
            raise GatewayError(400, f"{reason}: the session has ended (truncated)", "max_turns_exceeded")
        chars, most = sum(len(m.content) for m in messages), self.config.max_total_tokens
        if chars > most * self.renderer.max_token_chars:  # refused before tokenizing megabytes of text
            raise GatewayError(400, f"the conversation has {chars} characters, more than {most} tokens can hold "
                                    "(gateway.max_total_tokens)", "context_length_exceeded")
        async with session.lock:
            try:
                if sum(len(m.content) for m in messages) <= INLINE_PLAN_CHARS:
                    where = plan(session.segments, messages, tools, self.renderer)
                else:
                    where = await asyncio.to_thread(plan, session.segments, messages, tools, self.renderer)
            except RendererError as e:
                raise GatewayError(400, f"the chat template cannot render these messages: {e}") from None
            if where.segment is not None and not where.fork:
                where.segment.busy = True
        try:
            budget = self.config.max_total_tokens - len(where.prompt_ids)
            if budget < 1:
                session.overflow = (f"the conversation is {len(where.prompt_ids)} tokens; the gateway holds "
                                    f"{self.config.max_total_tokens} per segment (gateway.max_total_tokens)")
                raise GatewayError(400, session.overflow, "context_length_exceeded")
            stop_ids = tuple(dict.fromkeys(sampling.stop_token_ids + self.renderer.stop_token_ids))
            seed = sampling.seed if sampling.seed is not None or session.seed is None else \
                seeds.turn_seed(session.seed, session.calls)
            sampling = replace(sampling, max_tokens=min(sampling.max_tokens, budget), stop_token_ids=stop_ids,
                               seed=seed)
            version = self.policy.weight_version
            try:
                with self.timeline.engine:
                    samples = await self.policy.generate(where.prompt_ids, sampling)
            except Exception as e:
                session.failed_calls.append(f"{type(e).__name__}: {e}")
                raise GatewayError(502, f"the policy failed: {type(e).__name__}: {e}", "policy_error") from e
            parser = self.parser(tools) if tools and parse_tools else None
            replies = [self.reply(s, session, parser, sampling.stop) for s in samples]
            async with session.lock:
                session.last_active = time.monotonic()
                for i, r in enumerate(replies):
                    seg = commit(where, session.segments, messages, tools, r.sample, *self._recorded(r),
                                 version if r.sample.weight_version is None else r.sample.weight_version, fork=i > 0)
                    if r.parse_error:
                        session.parse_errors.append(f"segment {seg.index}: {r.parse_error}")
                session.refused_in_a_row = 0
        finally:  # after the commit: until then the segment's last turn is not the one this call continues
            if where.segment is not None:
                where.segment.busy = False
        return replies, len(where.prompt_ids)

    def parser(self, tools: Sequence[dict]) -> Any:
        """The tool-call parser for a request's tools (ReAct reads plain-text arguments of one-string tools)."""
        if self.config.tool_parser != "react":
            return PARSERS[self.config.tool_parser]()
        plain = {}
        for t in tools:
            params = t.get("function", {}).get("parameters", {}).get("properties", {})
            if len(params) == 1 and next(iter(params.values())).get("type") == "string":
                plain[t["function"]["name"]] = next(iter(params))
        return PARSERS["react"](default_args=plain)

    def reply(self, sample: Sample, session: Session, parser: Any | None, stop: Sequence[str] = ()) -> Reply:
        """The sampled text as an OpenAI message: the stop string it ended on cut (the sampled ids keep it), reasoning
        split off (if configured), tool calls parsed by `parser` (None: not parsed)."""
        ids = sample.token_ids
        text = self.renderer.decode(ids[:-1] if ids and ids[-1] in self.renderer.stop_token_ids else ids)
        cut = next((s for s in stop if text.endswith(s)), "") if sample.finish_reason == "stop" else ""
        text = text[:len(text) - len(cut)]
        reasoning, thought = None, ""
        if self.config.reasoning and "</think>" in text:
            head, rest = text.split("</think>", 1)
            reasoning, thought, text = head.removeprefix("<think>").strip(), text[:len(text) - len(rest.lstrip())], \
                rest.lstrip()
        finish = "length" if sample.finish_reason == "length" else "stop"
        parsed = parser.parse(text) if parser is not None else None
        if parsed is None or parsed.error or not parsed.tool_calls:
            return Reply(text, reasoning, thought, cut, (), finish, sample, parsed.error if parsed else None)
        calls = tuple(replace(c, id=f"call{next(session.call_ids):05d}") for c in parsed.tool_calls)
        return Reply(parsed.content or None, reasoning, thought, cut, calls, "tool_calls", sample)

    @staticmethod
    def _recorded(r: Reply) -> tuple[Message, frozenset[Key]]:
        """The reply as the template sees it (its reasoning and stop string in the content, as sampled), and the forms
        in which a client may send it back: as returned, or with the reasoning put back into the content."""
        content = r.content or ""
        template = Message("assistant", r.thought + content + r.cut, r.tool_calls)
        return template, frozenset(key(m) for m in (Message("assistant", content, r.tool_calls), template))
