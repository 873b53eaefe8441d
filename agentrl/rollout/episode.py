"""The rollout engine's record of one episode as it is played: the current segment's tokens, turns and messages, the
segments before it (a context policy's, agentrl/rollout/context.py), and what the episode as a whole reported.
`EpisodeBuilder.freeze` makes its trajectories: one per segment."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from agentrl.env.api import TextEnv
from agentrl.types import Message, StopReason, Task, Trajectory, Turn


@dataclass(frozen=True)
class Segment:
    """The token data of one segment of an episode, once a new segment took over."""

    ids: tuple[int, ...]
    mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    prompt_len: int
    turns: tuple[Turn, ...]
    messages: tuple[Message, ...]


@dataclass
class EpisodeBuilder:
    """Mutable builder of one episode: the current segment's tokens, turns and messages, the segments before it
    (a context policy's), and what the episode as a whole reported; `freeze` makes its trajectories."""

    task: Task
    group: int
    env_seed: int
    weight_version: int
    key: str = ""  # the play's unique key: the session of its segments
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_len: int = 0
    turns: list[Turn] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    task_len: int = 0  # the messages the env's reset gave (the task): every segment starts with them
    exchanges: list[int] = field(default_factory=list)  # where each turn's [assistant, *observation] starts
    closed: list[Segment] = field(default_factory=list)  # the segments before the current one
    summary_tokens: list[int] = field(default_factory=list)  # the length of each summary the policy wrote
    reward: float = 0.0
    components: dict[str, float] = field(default_factory=dict)
    tool_calls: int = 0
    invalid_actions: int = 0  # turns the env answered with a correction (malformed, unknown tool, ...)
    answer: str | None = None  # the final answer, when the env reports one (ToolEnv does)
    # What the env reports for the trajectory turn by turn (its step info's `per_turn`), as (turn, value) pairs by key:
    # the web envs' page screenshots.
    per_turn: dict[str, list[tuple[int, Any]]] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    env: TextEnv | None = None  # once `make_env` gave it; `_run_once` closes it
    slot: asyncio.Semaphore | None = None  # one of the env's `max_concurrent_episodes`, held until it is closed
    tools: list[dict[str, Any]] | None = None  # the tool schemas the env's reset gave, rendered into every turn
    close_error: str | None = None  # a failed or timed-out `env.close()`: noted, not the episode's outcome

    @property
    def total(self) -> int:
        """The episode's tokens so far: every segment's, prompts included."""
        return sum(len(s.ids) for s in self.closed) + len(self.ids)

    def extend(self, ids: Sequence[int], sampled: bool, logprobs: Sequence[float] | None = None,
               trainable: Sequence[int] = ()) -> None:
        """Append `ids` to the segment: sampled ones with mask 1 (or the policy's `trainable` mask) and their
        logprobs, the rest with mask 0 and logprob 0."""
        self.ids += ids
        self.mask += list(trainable) if sampled and trainable else [int(sampled)] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)

    def new_segment(self, messages: Sequence[Message], ids: Sequence[int], exchanges: list[int]) -> None:
        """Close the current segment and start the next from `messages` (rendered: `ids`, mask 0), whose turns
        start at `exchanges`."""
        self.closed.append(Segment(tuple(self.ids), tuple(self.mask), tuple(self.logprobs), self.prompt_len,
                                    tuple(self.turns), tuple(self.messages)))
        self.ids, self.mask, self.logprobs, self.turns = [], [], [], []
        self.messages, self.exchanges = list(messages), exchanges
        self.extend(ids, sampled=False)
        self.prompt_len = len(ids)

    def record(self, turn: int, reward: float, info: dict[str, Any]) -> None:
        """Take in what one env step reported."""
        self.reward += reward
        self.components.update(info.get("reward_components", {}))
        self.tool_calls += info.get("tool_calls", 0)
        self.invalid_actions += "invalid" in info
        self.answer = info.get("answer", self.answer)
        for key, value in info.get("per_turn", {}).items():
            self.per_turn.setdefault(key, []).append((turn, value))

    def freeze(self, stop: StopReason, reason: str) -> list[Trajectory]:
        """The episode's trajectories: one per segment, each with the episode's reward, stop and answer."""
        segments = [*self.closed, Segment(tuple(self.ids), tuple(self.mask), tuple(self.logprobs), self.prompt_len,
                                           tuple(self.turns), tuple(self.messages))]
        metrics = {"tool_calls": self.tool_calls, "invalid_actions": self.invalid_actions,
                   "seconds": round(time.perf_counter() - self.started, 3)}
        logs = {**({"close_error": self.close_error} if self.close_error else {}), **self.per_turn}
        if len(segments) > 1:  # what the episode did as a whole, on each of its segments
            metrics |= {"segments": len(segments), "summaries": len(self.summary_tokens),
                        "summary_tokens": sum(self.summary_tokens),
                        "episode_sampled_tokens": sum(sum(s.mask) for s in segments),
                        "episode_turns": sum(len(s.turns) for s in segments)}
        return [self._trajectory(s, k, stop, reason, metrics, logs, session=self.key if len(segments) > 1 else None)
                for k, s in enumerate(segments)]

    def _trajectory(self, s: Segment, k: int, stop: StopReason, reason: str, metrics: dict[str, float],
                    logs: dict[str, Any], session: str | None) -> Trajectory:
        # sampled tokens a frozen partner wrote (tandem rollouts) keep loss mask 0
        untrained = sum(t.end - t.start - sum(s.mask[t.start:t.end]) for t in s.turns)
        metrics = {**metrics, **({"untrained_tokens": untrained} if untrained else {})}
        logs = {**logs, **({"segment": k} if session else {})}
        return Trajectory(
            task_id=self.task.id, token_ids=s.ids, loss_mask=s.mask, logprobs=s.logprobs, prompt_len=s.prompt_len,
            turns=s.turns, reward=self.reward, reward_components=self.components, stop=stop, reason=reason,
            messages=s.messages, group=self.group, seed=self.env_seed, answer=self.answer, session=session,
            metrics=metrics, logs=logs,
            weight_version=min((t.weight_version for t in s.turns), default=self.weight_version))
