"""Memory across episodes, Reflexion-style (Shinn et al. 2023): the agent writes itself a note after a failed
attempt, and reads its notes on the same task at the next reset.

`ReflexionEnv` wraps any env. When the wrapped episode ends without full reward (an answer scored below
`max_reward`, or truncated), the episode goes on for one more turn: the env asks for a short note on what went
wrong, and the policy's reply is stored under the task's id in a `NoteStore`. The episode then ends as the wrapped
one did (its reward, answer and status are unchanged). At each reset the task's latest notes (at most `max_notes`,
each cut to `max_note_chars`) are added to the episode's opening message. An episode that the rollout engine cuts
(a turn past `max_tokens`, the episode past `max_total_tokens`, an error) never reaches the env's end: no note.

The note-writing turn is sampled like any other; with `train_notes = False` (the default) the env marks it
untrained (`info["untrained"]`) and the rollout engine gives its tokens loss mask 0: the policy is trained on
solving, not on writing notes for a reward it cannot see. With `train_notes = True` the turn shares the episode's
reward and advantage. Either way the note costs one turn of the rollout's `max_turns`.

The rollout engine makes an env per episode, so the notes live in a store that outlives envs: named stores
(`store = "NAME"`) are shared by every env of the process that names them and plays the same split (a training
run's episodes); without a name each env has its own and remembers nothing. A training run's held-out evaluations
share theirs too: the evaluation after RL opens with the notes of the one before. `agentrl attempts`
(agentrl/eval/attempts.py) gives each condition its own store and measures success at attempt k, with and without
memory.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Sequence

import gymnasium as gym

from agentrl.env.api import TextEnv
from agentrl.env.registry import make
from agentrl.types import Message, Task

REFLECT_PROMPT = ("That attempt did not succeed. Write a note of at most two sentences for your next attempt at this "
                  "same task: what went wrong, and what to do differently. Do not call tools; write only the note.")
NOTES_HEADER = "Notes you wrote after your earlier failed attempts at this task:"


class NoteStore:
    """Notes per task id, the latest `max_notes` of each; thread-safe (episodes run in several threads)."""

    _named: dict[str, NoteStore] = {}
    _named_lock = threading.Lock()

    def __init__(self, max_notes: int = 3):
        if max_notes < 1:
            raise ValueError(f"max_notes must be >= 1, got {max_notes}")
        self.max_notes = max_notes
        self._notes: dict[str, deque[str]] = {}
        self._lock = threading.Lock()

    @classmethod
    def named(cls, name: str, max_notes: int = 3) -> NoteStore:
        """The process's store called `name`, made on first use."""
        with cls._named_lock:
            store = cls._named.setdefault(name, cls(max_notes))
        if store.max_notes != max_notes:
            raise ValueError(f"note store {name!r} keeps {store.max_notes} notes per task, not {max_notes}: give every "
                             "env that shares it the same max_notes")
        return store

    def add(self, task_id: str, note: str) -> None:
        """Keeps `note` as the task's latest."""
        with self._lock:
            self._notes.setdefault(task_id, deque(maxlen=self.max_notes)).append(note)

    def notes(self, task_id: str) -> list[str]:
        """The task's notes, oldest first."""
        with self._lock:
            return list(self._notes.get(task_id, ()))

    def __len__(self) -> int:
        with self._lock:
            return sum(len(n) for n in self._notes.values())


class ReflexionEnv(TextEnv):
    """`env` (an env id and its kwargs, or an instance) with notes across episodes; see the module's docstring."""

    def __init__(self, env: str | TextEnv, env_kwargs: dict[str, Any] | None = None, split: str = "train",
                 store: str | NoteStore | None = None, max_notes: int = 3, max_note_chars: int = 400,
                 train_notes: bool = False, reflect_prompt: str = REFLECT_PROMPT):
        self.inner = make(env, split=split, **(env_kwargs or {})) if isinstance(env, str) else env
        super().__init__(split=self.inner.split, max_turns=self.inner.max_turns + 1)
        if max_note_chars < 1:
            raise ValueError(f"max_note_chars must be >= 1, got {max_note_chars}")
        self.store = store if isinstance(store, NoteStore) else (  # a named store: one per split
            NoteStore.named(f"{store}/{self.inner.split}", max_notes) if store else NoteStore(max_notes))
        self.max_note_chars, self.train_notes, self.reflect_prompt = max_note_chars, train_notes, reflect_prompt
        self.max_reward, self.max_concurrent_episodes = self.inner.max_reward, self.inner.max_concurrent_episodes
        self._ending: dict[str, Any] | None = None  # the wrapped episode's end, while the note is written
        self._noted, self._earned = False, 0.0

    @property
    def tasks(self) -> Sequence[Task]:
        """The wrapped env's tasks."""
        return self.inner.tasks

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """The wrapped env's tools."""
        return self.inner.tool_schemas

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """The wrapped env's reset, with the task's notes added to its opening message."""
        gym.Env.reset(self, seed=seed)  # this env's own random generator, as Gymnasium's checker expects
        obs, info = self.inner.reset(seed=seed, options=options)
        self.task, self.turn, self._ending, self._noted, self._earned = self.inner.task, 0, None, False, 0.0
        notes = self.store.notes(self.task.id)
        if not notes:
            return obs, info
        block = "\n".join([NOTES_HEADER, *(f"{i}. {n}" for i, n in enumerate(notes, 1))])
        *head, last = obs
        opening = (*head, Message(last.role, f"{last.content}\n\n{block}")) if last.role == "user" else (
            *obs, Message("user", block))
        return opening, {**info, "notes": len(notes)}

    def step(self, action: str):
        """The wrapped env's step (its `info["assistant"]` too); after a failed end, the turn that writes the note."""
        if self._ending is not None:  # this action is the note
            note = " ".join(action.split())[:self.max_note_chars]
            if note:
                self.store.add(self.task.id, note)
            ending, self._ending, self._noted = self._ending, None, True
            info = {"reason": ending["reason"], "note": note, "assistant": Message("assistant", action),  # plain text
                    **({} if self.train_notes else {"untrained": True})}
            return (), 0.0, ending["terminated"], not ending["terminated"], info
        self.turn += 1
        obs, reward, terminated, truncated, info = self.inner.step(action)
        self._earned += reward
        if (terminated or truncated) and self._earned < self.max_reward - 1e-9:
            self._ending = {"terminated": terminated, "reason": info.get("reason", "")}
            return (*obs, Message("user", self.reflect_prompt)), reward, False, False, info
        return obs, reward, terminated, truncated, info

    def assistant_message(self, action: str) -> Message:
        """The wrapped env's reading of the action; the note is plain text."""
        return Message("assistant", action) if self._noted else self.inner.assistant_message(action)

    def load_tasks(self, split: str) -> Sequence[Task]:
        """Unused: the wrapped env's tasks are this env's."""
        return self.inner.tasks

    def first_messages(self, task: Task) -> Sequence[Message]:
        """Unused: `reset` takes the wrapped env's opening."""
        return self.inner.first_messages(task)

    def act(self, action: str):
        """Unused: `step` drives the wrapped env."""
        raise NotImplementedError("ReflexionEnv steps the wrapped env itself")

    def gold_actions(self, task: Task) -> list[str]:
        """The wrapped env's gold solution (it succeeds: no note)."""
        return self.inner.gold_actions(task)

    def demonstration(self, task: Task, rng, error_rate: float = 0.0) -> list[str]:
        """The wrapped env's expert."""
        return self.inner.demonstration(task, rng, error_rate)

    def difficulty(self, task: Task) -> dict[str, Any]:
        """The wrapped env's difficulty."""
        return self.inner.difficulty(task)

    def check_step(self, text: str) -> bool | None:
        """The wrapped env's process checker."""
        return self.inner.check_step(text)

    def close(self) -> None:
        """Closes the wrapped env."""
        self.inner.close()
