"""Any agentrl env behind an OpenEnv server (`agentrl serve env ID`), so that other trainers can use ours.

It speaks OpenEnv's protocol with OpenEnv's own server (`openenv.core.env_server.create_app`): a WebSocket
session per episode at `/ws` (`reset`, `step`, `state`, `close` messages), with up to `max_sessions` at once,
each with its own env instance; `/health`, `/schema` and `/metadata` as usual. (OpenEnv's plain HTTP `/reset`
and `/step` make a fresh env per request, so multi-turn episodes need the WebSocket, as OpenEnv's clients use.)

    action       {"text": "<the assistant's turn>"}
    observation  {"messages": [{"role", "content", "tool_calls", "tool_call_id", "name"}, ...],
                  "done": bool, "reward": float | null, "metadata": {task_id, tools (at reset), info (at step)}}
    reset        {"seed": int, "task_index": int | null, "split": str | null}
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_app

from agentrl.env.registry import make


class TextAction(Action):
    """The action: the assistant's turn as text."""

    text: str


class MessagesObservation(Observation):
    """The observation: the env's new chat messages, as dicts."""

    messages: list[dict[str, Any]] = []


def _json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _messages(messages) -> list[dict[str, Any]]:
    return [_json_safe(dataclasses.asdict(m)) for m in messages]


def build_app(env_id: str, max_sessions: int = 64, **env_kwargs: Any):
    """The FastAPI app of an OpenEnv server for `env_id` (made with `env_kwargs`)."""
    make(env_id, **env_kwargs).close()  # fail now, with the registry's message, not in the first session

    class AgentrlEnvironment(Environment[TextAction, MessagesObservation, State]):
        SUPPORTS_CONCURRENT_SESSIONS = True  # one env instance per WebSocket session

        def __init__(self):
            super().__init__()
            self.env = make(env_id, **env_kwargs)
            self._state = State(episode_id=str(uuid.uuid4()), step_count=0)

        def reset(self, seed: int | None = None, episode_id: str | None = None, task_index: int | None = None,
                  split: str | None = None, **kwargs: Any) -> MessagesObservation:
            if split is not None and split != self.env.split:
                self.env.close()
                self.env = make(env_id, **{**env_kwargs, "split": split})
            options = {"task": self.env.tasks[task_index]} if task_index is not None else None
            obs, info = self.env.reset(seed=seed, options=options)
            self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
            return MessagesObservation(messages=_messages(obs), done=False, reward=None,
                                       metadata={"task_id": info["task_id"], "tools": _json_safe(info["tools"])})

        def step(self, action: TextAction, **kwargs: Any) -> MessagesObservation:
            obs, reward, terminated, truncated, info = self.env.step(action.text)
            self._state.step_count += 1
            info = {k: v for k, v in info.items() if k != "assistant"}  # agentrl's own reading of the action
            return MessagesObservation(messages=_messages(obs), done=terminated or truncated, reward=reward,
                                       metadata={"terminated": terminated, "truncated": truncated,
                                                 "info": _json_safe(info)})

        @property
        def state(self) -> State:
            return self._state

        def close(self) -> None:
            self.env.close()

    return create_app(AgentrlEnvironment, TextAction, MessagesObservation, env_name=env_id,
                      max_concurrent_envs=max_sessions)
