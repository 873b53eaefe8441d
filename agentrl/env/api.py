"""The environment API: a Gymnasium env whose action is the assistant's text and whose observation is a
tuple of chat messages (DESIGN.md, "Boundaries that must hold").

`ToolEnv` is the base for tool-using envs: it parses the assistant's text with a tool-call parser, turns
malformed actions into corrective observations, runs valid tool calls (each with a timeout), and asks the
subclass to score a final answer. A subclass provides tasks, the first messages, the tools, a scorer and
a gold solution (for `validate()`).
"""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass, replace
from typing import Any, Sequence

import gymnasium as gym
import numpy as np

from agentrl.tools import ParsedAction, ToolSet
from agentrl.types import Message, Task, ToolCall

Observation = tuple[Message, ...]


class UnicodeText(gym.spaces.Text):
    """A text space that accepts any unicode string up to `max_length` (Gymnasium's `Text` accepts only
    its charset). Samples are drawn from a mixed charset so that `check_env` sends realistic junk."""

    _SAMPLE_CHARS = (
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \n\t{}[]<>/\"':,.=+-*()_"
        "éßλ中文🙂\u200b"
    )

    def __init__(self, max_length: int = 100_000, seed: int | None = None):
        super().__init__(max_length, min_length=0, charset=self._SAMPLE_CHARS, seed=seed)

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        # Short samples: the full max_length would make check_env slow for no gain.
        length = int(self.np_random.integers(0, 200))
        chars = self.np_random.choice(list(self._SAMPLE_CHARS), size=length)
        return "".join(chars)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"UnicodeText(max_length={self.max_length})"


class MessagesSpace(gym.spaces.Space):
    """Observations: a tuple of `Message`s with string content and a known role."""

    ROLES = ("system", "user", "assistant", "tool")

    def __init__(self, seed: int | None = None):
        super().__init__(shape=None, dtype=None, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, tuple) and all(
            isinstance(m, Message) and m.role in self.ROLES and isinstance(m.content, str) for m in x
        )

    def sample(self, mask: Any = None, probability: Any = None) -> Observation:
        return (Message("user", str(self.np_random.integers(0, 1_000_000))),)

    @property
    def is_np_flattenable(self) -> bool:
        return False


@dataclass(frozen=True)
class Score:
    """The scorer's verdict on a final answer: named reward components, combined by the env's weights."""

    components: dict[str, float]
    detail: str = ""


class EnvNotReady(RuntimeError):
    """What an env needs outside this process is not there (`TextEnv.check_ready`); the message says the fix."""


class TextEnv(gym.Env[Observation, str]):
    """A multi-turn text environment over a list of tasks.

    `reset(seed, options={"task": Task})` plays the given task; without a task, the seed picks one from
    `self.tasks`. Subclasses implement `load_tasks`, `first_messages`, `act` and `gold_actions`.
    """

    metadata = {"render_modes": []}
    max_reward: float = 1.0
    # Episodes of this env that can run at once in one process (their sandbox pool's size); None: no limit. The
    # rollout engine keeps the rest waiting before they reset, so that none blocks an env thread on the pool.
    max_concurrent_episodes: int | None = None

    def __init__(self, split: str = "train", max_turns: int = 8):
        self.split = split
        self.max_turns = max_turns
        self.action_space = UnicodeText()
        self.observation_space = MessagesSpace()
        self._tasks: Sequence[Task] | None = None
        self.task: Task | None = None
        self.turn = 0

    @property
    def tasks(self) -> Sequence[Task]:
        """The split's tasks, loaded by `load_tasks` on first use."""
        if self._tasks is None:  # lazy: building tasks can be slow and not every user needs them
            self._tasks = self.load_tasks(self.split)
        return self._tasks

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """Tool schemas (OpenAI function format) that the chat template puts into the prompt."""
        return []

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        task = (options or {}).get("task")
        if task is None:
            task = self.tasks[int(self.np_random.integers(len(self.tasks)))]
        if not isinstance(task, Task):
            raise TypeError(f"options['task'] must be an agentrl Task, got {type(task).__name__}")
        self.task, self.turn = task, 0
        self.on_reset(task)
        return tuple(self.first_messages(task)), {"task_id": task.id, "tools": self.tool_schemas}

    def step(self, action: str):
        """One turn (`act`), truncated at `max_turns`. `info["assistant"]` hands back the action as a chat message
        (`act`'s, or else `assistant_message`'s), so that the rollout engine renders it without parsing it again."""
        if self.task is None:
            raise gym.error.ResetNeeded("Call reset() before step().")
        self.turn += 1
        obs, reward, terminated, info = self.act(action)
        truncated = not terminated and self.turn >= self.max_turns
        if truncated:
            info = {**info, "reason": f"max_turns={self.max_turns}"}
        if "assistant" not in info:
            info = {**info, "assistant": self.assistant_message(action)}
        return tuple(obs), float(reward), terminated, truncated, info

    # ---- the subclass's part ----
    @abc.abstractmethod
    def load_tasks(self, split: str) -> Sequence[Task]:
        """The tasks of `split`; `tasks` calls it once, on first use."""

    @abc.abstractmethod
    def first_messages(self, task: Task) -> Sequence[Message]:
        """The observation at reset: the messages that open an episode of `task` (called after `on_reset`)."""

    @abc.abstractmethod
    def act(self, action: str) -> tuple[Sequence[Message], float, bool, dict[str, Any]]:
        """One turn: (observation messages, reward, terminated, info).

        The rollout engine reads these `info` keys: `reward_components` (named parts of the reward), `tool_calls`
        (how many ran), `answer` (the final answer), `reason` (why the episode ended), `untrained` (true: the
        action of this turn is not trained on; its tokens get loss mask 0, as `ReflexionEnv`'s notes), `per_turn`,
        a dict whose values it collects into the trajectory's `logs` as (turn, value) pairs by key (the web envs'
        `screenshots`), and `assistant`, the action as a chat message, for an env that parsed it here anyway
        (`ToolEnv`; without it, `step` asks `assistant_message`)."""

    @abc.abstractmethod
    def gold_actions(self, task: Task) -> list[str]:
        """Assistant texts that solve `task`; `validate()` feeds them through the env."""

    def demonstration(self, task: Task, rng: random.Random, error_rate: float = 0.0) -> list[str]:
        """Assistant texts of an expert for SFT warm starts: the gold solution, and with probability
        `error_rate` a plausible mistake where the env knows how to make one."""
        return self.gold_actions(task)

    def expert_turn(self, prompt: str, summary: bool = False, mistake: bool = False) -> str | None:
        """An expert's next turn read from the conversation so far (`prompt`, as rendered), or, with `summary`, its
        summary of it (asked for by the `compact` context policy); with `mistake`, a plausible mistake where the env
        knows how to make one. Expert demonstrations play with the rollout's context policy where an env has this
        expert; None (the default): the env has none, and its demonstrations play whole, from `demonstration`."""
        return None

    def on_reset(self, task: Task) -> None:
        """Hook for per-episode state."""

    def check_ready(self) -> None:
        """What the env needs outside this process (a Docker daemon, a browser), checked where a job or an evaluation
        starts, before any model loads or server starts: an `EnvNotReady` whose message says the fix. Without it,
        every episode would end as `error` for the same reason, hours later. Default: nothing to check."""

    def difficulty(self, task: Task) -> dict[str, Any]:
        """What makes this task harder than others (e.g. `{"hops": 3}`), for evaluation breakdowns."""
        return {}

    def assistant_message(self, action: str) -> Message:
        """The assistant's text as a chat message (content + parsed tool calls), for the chat template."""
        return Message("assistant", action)

    def check_step(self, text: str) -> bool | None:
        """The env's own process checker on one assistant turn: correct, incorrect, or None (nothing to
        check, or no checker). Used to measure how well a learned process verifier agrees with it."""
        return None

    # ---- the model-free check ----
    def validate(self, n_tasks: int = 8, tasks: Sequence[Task] | None = None) -> list[str]:
        """Feed the gold solution of the first `n_tasks` tasks (or of `tasks`) through the env; return the
        failures."""
        failures = []
        for task in list(tasks) if tasks is not None else list(self.tasks)[:n_tasks]:
            self.reset(seed=0, options={"task": task})
            total, done = 0.0, False
            for action in self.gold_actions(task):
                _, reward, terminated, truncated, info = self.step(action)
                total += reward
                done = terminated or truncated
                if done:
                    break
            if not done or not np.isclose(total, self.max_reward):
                failures.append(f"task {task.id}: gold solution got reward {total} (max {self.max_reward}), "
                                f"ended={done}, last info={info}")
        return failures


class ToolEnv(TextEnv):
    """A `TextEnv` where the model acts through tools and ends the episode with a final answer.

    Malformed actions (bad call syntax, unknown tool, wrong argument types, too many calls, no action at
    all) become a corrective user message; `max_invalid` of them in a row end the episode with reward 0.
    Reward = sum of `reward_weights[k] * component[k]` over the scorer's components.

    `answer_tool` names a tool whose call is the final answer (its one argument is the answer), for
    envs whose answers go through the tool-call format rather than the parser's answer syntax.
    """

    def __init__(self, toolset: ToolSet, parser, split: str = "train", max_turns: int = 8,
                 max_invalid: int = 3, reward_weights: dict[str, float] | None = None,
                 answer_tool: str | None = None):
        super().__init__(split=split, max_turns=max_turns)
        if answer_tool is not None and answer_tool not in toolset:
            raise ValueError(f"answer_tool {answer_tool!r} is not one of the tools: {toolset.names}")
        self.toolset, self.parser, self.max_invalid = toolset, parser, max_invalid
        self.answer_tool = answer_tool
        self.reward_weights = dict(reward_weights or {"outcome": 1.0})
        self.max_reward = sum(w for w in self.reward_weights.values() if w > 0)
        self.transcript: list[ParsedAction] = []
        self.invalid_in_a_row = 0

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return self.toolset.schemas

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self.toolset.new_episode()  # servers of the last episode that must not serve the next one stop here
        return super().reset(seed=seed, options=options)

    def close(self) -> None:
        self.toolset.close()
        super().close()

    def on_reset(self, task: Task) -> None:
        self.transcript, self.invalid_in_a_row = [], 0

    def assistant_message(self, action: str) -> Message:
        return _as_message(action, self.parser.parse(action), self.parser.template_syntax)

    def act(self, action: str):
        parsed = self.parser.parse(action)  # once a turn: the action's outcome and its chat message both read it
        self.transcript.append(parsed)
        obs, reward, done, info = self._respond(parsed)
        return obs, reward, done, {**info, "assistant": _as_message(action, parsed, self.parser.template_syntax)}

    def _respond(self, parsed: ParsedAction):
        """`act` on the parsed action: a final answer scored, valid tool calls run, anything else corrected."""
        problem = parsed.error
        if problem is None and parsed.answer is not None:
            if not parsed.tool_calls:
                return self._finish(parsed.answer)
            problem = "Give either tool calls or a final answer in one turn, not both."
        if problem is None:
            problem = self.toolset.check(parsed.tool_calls)
        if problem is None and not parsed.tool_calls:
            problem = f"No tool call or final answer found. {self.parser.instructions}"
        answering = any(call.name == self.answer_tool for call in parsed.tool_calls)
        if problem is None and answering:
            if len(parsed.tool_calls) > 1:
                problem = f"Call {self.answer_tool} alone, in a turn without other tool calls."
            else:
                return self._finish(str(next(iter(parsed.tool_calls[0].arguments.values()))))
        if problem is not None:
            return self._invalid(problem)
        self.invalid_in_a_row = 0
        # ToolError propagates: it is an infrastructure failure, not the model's, and ends as `error`.
        results = [Message("tool", self.toolset.run(call), tool_call_id=call.id, name=call.name)
                   for call in with_ids(parsed.tool_calls)]
        return results, 0.0, False, {"tool_calls": len(results)}

    def _invalid(self, problem: str):
        self.invalid_in_a_row += 1
        done = self.invalid_in_a_row >= self.max_invalid
        info = {"invalid": problem}
        if done:
            info["reason"] = f"{self.max_invalid} invalid actions in a row"
        return [Message("user", f"Invalid action: {problem}")], 0.0, done, info

    def _finish(self, answer: str):
        score = self.score(self.task, answer, self.transcript)
        reward = sum(self.reward_weights.get(k, 0.0) * v for k, v in score.components.items())
        return [], reward, True, {"reward_components": dict(score.components), "detail": score.detail,
                                  "answer": answer}

    @abc.abstractmethod
    def score(self, task: Task, answer: str, transcript: Sequence[ParsedAction]) -> Score:
        """Score the final answer (and, for process rewards, the whole transcript)."""


def with_ids(calls: Sequence[ToolCall]) -> tuple[ToolCall, ...]:
    """Number the calls of one turn. Ids are 9 alphanumerics because Mistral's template insists."""
    return tuple(replace(c, id=f"call{i:05d}") for i, c in enumerate(calls))


def _as_message(action: str, parsed: ParsedAction, template_syntax: bool) -> Message:
    """The assistant's turn as a chat message: its numbered tool calls beside its other text when the parser writes
    calls as the chat template renders them (Hermes'); otherwise (a final answer, a malformed turn, ReAct's or
    Search-R1's calls) the text as written, so that a window rendered afresh (`sliding_window`) shows the model its
    turns as it wrote them, not in a syntax it never wrote."""
    if parsed.error or not parsed.tool_calls or not template_syntax:
        return Message("assistant", action)
    return Message("assistant", parsed.content, with_ids(parsed.tool_calls))
