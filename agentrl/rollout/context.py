"""Context policies: what an episode does when its conversation outgrows its window (docs/concepts/trajectories.md).

    truncate        one segment: the episode stops when `max_total_tokens` runs out (the default)
    sliding_window  a new segment starts from the task and the latest turns that fit the window
    compact         the policy writes a summary of its work so far (sampled and trained, as any turn); a new segment
                    starts from the task and that summary

Each segment is a trajectory of its own, exact tokens as ever; the segments of one episode share its
`Trajectory.session`, carry its reward and status, and GRPO counts them as one sample (one advantage).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

from pydantic import with_config

from agentrl.config import STRICT
from agentrl.renderer import Ids
from agentrl.types import Message

POLICIES = ("truncate", "sliding_window", "compact")

SUMMARY_PROMPT = ("Your context is almost full. Summarize your work so far for yourself: the facts you found, with "
                  "their exact values, what you tried, and what is left to do. The task continues from your summary "
                  "alone.")
RESUME_PROMPT = "Continue the task from your summary above."


@with_config(STRICT)
@dataclass(frozen=True)
class ContextConfig:
    """`[*.rollout.context]`: the episode's context policy (`POLICIES`). With sliding_window or compact,
    `max_total_tokens` bounds the whole episode (every segment's tokens, re-rendered prompts included) and
    `window` each segment."""

    policy: str = "truncate"
    window: int | None = None  # tokens of one segment: prompt, turns, observations; sliding_window and compact only
    summary_prompt: str = SUMMARY_PROMPT  # compact: what asks the policy for its summary (appended to the observation)
    resume_prompt: str = RESUME_PROMPT  # compact: the user message after the summary in the new segment
    summary_tokens: int = 256  # compact: the summary's max_tokens

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"context.policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.policy == "truncate" and self.window is not None:
            raise ValueError("context.window is the segment size of sliding_window and compact; with truncate the "
                             "episode is one segment of max_total_tokens: drop window, or choose a policy")
        if self.policy != "truncate" and (self.window is None or self.window < 1):
            raise ValueError(f"context.policy = {self.policy!r} needs context.window (tokens per segment), "
                             f"got {self.window}")
        if self.summary_tokens < 1:
            raise ValueError(f"context.summary_tokens must be >= 1, got {self.summary_tokens}")

    def check(self, max_total_tokens: int, max_tokens: int) -> None:
        """Refuse a window that never applies or cannot hold a turn."""
        if self.window is None:
            return
        if self.window >= max_total_tokens:
            raise ValueError(f"context.window ({self.window}) must be below max_total_tokens ({max_total_tokens}), "
                             "the whole episode's budget, or no segment ever ends: raise max_total_tokens")
        need = max_tokens + (self.summary_tokens if self.policy == "compact" else 0)
        if self.window <= need:
            raise ValueError(f"context.window ({self.window}) must exceed sampling.max_tokens ({max_tokens})"
                             + (f" + summary_tokens ({self.summary_tokens})" if self.policy == "compact" else "")
                             + ", with room for the prompt")


def with_request(observation: Sequence[Message], prompt: str) -> tuple[Message, ...]:
    """`observation` followed by the summary request: added to its last message when that is the user's, so that
    templates which want user and assistant turns to alternate accept it."""
    if observation and observation[-1].role == "user":
        last = observation[-1]
        return (*observation[:-1], replace(last, content=f"{last.content}\n\n{prompt}"))
    return (*observation, Message("user", prompt))


def resumed(task: Sequence[Message], summary: str, resume_prompt: str) -> list[Message]:
    """The conversation a compacted episode goes on from: the task, the policy's summary, the resume prompt."""
    return [*task, Message("assistant", summary), Message("user", resume_prompt)]


def latest_turns(task: Sequence[Message], turns: Sequence[Sequence[Message]],
                 fits: Callable[[list[Message]], Ids | None]
                 ) -> tuple[list[Message], Ids, Sequence[Sequence[Message]]] | None:
    """The task and the latest turns (each an assistant message and its observation), as many as `fits` (it returns
    the rendering's ids, or None): the messages, their ids and the turns kept; None when not even the latest turn
    fits beside the task."""
    for k in range(len(turns), 0, -1):
        messages = [*task, *(m for turn in turns[-k:] for m in turn)]
        ids = fits(messages)
        if ids is not None:
            return messages, ids, turns[-k:]
    return None
