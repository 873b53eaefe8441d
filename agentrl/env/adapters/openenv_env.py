"""An OpenEnv server's environment as an agentrl env: `openenv/remote-v0` with `url="http://host:port"`.

Each episode opens its own WebSocket session through OpenEnv's `GenericEnvClient` (one env instance on the
server per episode). Observations map onto chat messages: an observation with a `messages` list (chat-style
envs, and agentrl envs served by `agentrl serve env`) gives those; otherwise its `prompt` / `text` /
`message` field, or the JSON of the whole observation, becomes one user message. The action is
`{action_field: <assistant text>}` (default `text`); servers with structured actions need their own mapping
(`action=lambda text: {...}`). Tasks are seeds (`reset(seed=...)`, plus `task_index` for agentrl servers).
The reward is the server's. No gold solutions: `validate()` needs a `solver(messages) -> text`.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

from agentrl.env.adapters.seeded import SeededEnv
from agentrl.types import Message, Task


class OpenEnvEnv(SeededEnv):
    """An env on an OpenEnv server at `url`, one WebSocket session per episode; tasks are seeds."""

    task_prefix, solver_signature = "openenv", "(messages) -> text"

    def __init__(self, url: str, split: str = "train", n_tasks: int = 1000, max_turns: int = 30,
                 action_field: str = "text", action: Callable[[str], dict] | None = None,
                 agentrl_server: bool = False, solver: Callable[[list[Message]], str] | None = None):
        try:
            from openenv.core import GenericEnvClient
        except ImportError as e:
            raise ImportError("the OpenEnv adapter needs `pip install --no-deps openenv 'fastmcp>=4' websockets` "
                              "(or make setup-adapters)") from e
        super().__init__(split, max_turns, n_tasks, solver)
        self.url, self.agentrl_server = url, agentrl_server
        self.to_action = action or (lambda text: {action_field: text})
        self._client_cls, self.client = GenericEnvClient, None
        self._first: list[Message] = []
        self.history: list[Message] = []

    def on_reset(self, task: Task) -> None:
        self.close()
        self.client = self._client_cls(base_url=self.url).sync()
        self.client.connect()
        kwargs = {"task_index": task.data["index"], "split": self.split} if self.agentrl_server else {}
        result = self.client.reset(seed=task.data["seed"], **kwargs)
        self._first = self.history = to_messages(result.observation)

    def first_messages(self, task: Task) -> Sequence[Message]:
        """The messages of the server's observation at reset."""
        return tuple(self._first)

    def act(self, action: str):
        self.history = [*self.history, Message("assistant", action)]
        result = self.client.step(self.to_action(action))
        observation = to_messages(result.observation) if not result.done or _has_messages(result.observation) else []
        self.history += observation
        reward = float(result.reward or 0.0)
        info = {"reward_components": {"openenv": reward}} if result.done else {}
        return observation, reward, bool(result.done), info

    def solver_inputs(self) -> tuple:
        return (self.history,)

    def close(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            client.close()


def _has_messages(observation: Any) -> bool:
    return isinstance(observation, dict) and bool(observation.get("messages"))


def to_messages(observation: Any) -> list[Message]:
    """An OpenEnv observation (a dict) as chat messages."""
    if isinstance(observation, dict):
        if isinstance(observation.get("messages"), list):
            return [Message(m.get("role", "user"), m.get("content") or "", tool_call_id=m.get("tool_call_id"),
                            name=m.get("name")) for m in observation["messages"]]
        for key in ("prompt", "text", "message"):
            if isinstance(observation.get(key), str):
                return [Message("user", observation[key])]
    return [Message("user", json.dumps(observation, default=str))]
