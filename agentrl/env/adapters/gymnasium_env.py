"""Any Gymnasium env as an agentrl env: `GymnasiumEnv(gym_id="Taxi-v3", render_mode="ansi")`, registered like
`gymnasium/FrozenLake-v1` (`agentrl.register("gymnasium/Taxi-v3", "agentrl.env.adapters.gymnasium_env:GymnasiumEnv",
gym_id="Taxi-v3", ...)`).

Observations become a user message: the env's own text when its observation space is `Text`, else
`str(observation)`, after the env's drawing with `render_mode="ansi"` (toy-text envs draw their grid; the
colour codes, which mark the agent on FrozenLake, are removed, so the observation itself is kept). Actions: the
assistant's text as is for a `Text` action space; for `Discrete(n)`, the first integer in the text (an action
outside 0..n-1, or none, gets a corrective message and no step). Tasks are seeds: `Task("<id>/<seed>")`.
No gold solutions exist for an arbitrary env: `validate()` needs a `solver(env, observation) -> action`
(a function or "module:function"); `gymnasium/FrozenLake-v1` is registered with a BFS solver.
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Callable, Sequence

import gymnasium as gym

from agentrl.env.adapters.seeded import SeededEnv
from agentrl.types import Message, Task

SYSTEM_PROMPT = "You act in an environment. {actions} Observations come as text."


class GymnasiumEnv(SeededEnv):
    """A Gymnasium env (`gym_id`, made with `make_kwargs`) played in text; tasks are seeds."""

    solver_signature = "(env, observation) -> action"

    def __init__(self, gym_id: str, split: str = "train", n_tasks: int = 1000, max_turns: int = 50,
                 max_reward: float = 1.0, solver: Callable[[gym.Env, Any], Any] | str | None = None,
                 instructions: str = "", **make_kwargs: Any):
        if isinstance(solver, str):  # "module:function", as registrations name it
            module, _, name = solver.partition(":")
            solver = getattr(importlib.import_module(module), name)
        super().__init__(split, max_turns, n_tasks, solver)
        self.env_id = self.task_prefix = gym_id
        self.max_reward = max_reward
        self.inner = gym.make(gym_id, **make_kwargs)
        space = self.inner.action_space
        if isinstance(space, gym.spaces.Discrete):
            self.actions = f"Answer with one integer action from {space.start} to {space.start + space.n - 1}."
        elif isinstance(space, gym.spaces.Text):
            self.actions = "Answer with your action as text."
        else:
            raise ValueError(f"{gym_id}'s action space {space} is neither Discrete nor Text: "
                             "no text action maps onto it")
        self.actions = f"{instructions} {self.actions}".strip()
        self._first = ""
        self.total = 0.0

    def on_reset(self, task: Task) -> None:
        self.observation, _ = self.inner.reset(seed=task.data["seed"])
        self._first, self.total = self.text(self.observation), 0.0

    def first_messages(self, task: Task) -> Sequence[Message]:
        """The system prompt with the action instructions, and the first observation as a user message."""
        return (Message("system", SYSTEM_PROMPT.format(actions=self.actions)), Message("user", self._first))

    def text(self, observation: Any) -> str:
        """An observation as text: a string as is; else `str(observation)`, after the env's ansi drawing (without
        colours) when it draws one."""
        if isinstance(observation, str):
            return observation
        if self.inner.render_mode == "ansi":  # the drawing, without its colours, and the observation itself
            drawing = re.sub(r"\x1b\[[0-9;]*m", "", str(self.inner.render())).strip("\n")
            return f"{drawing}\n(observation: {observation})"
        return str(observation)

    def parse(self, action: str) -> tuple[Any, str | None]:
        """The assistant's text as an action of the inner env: `(action, None)`, or `(None, corrective message)`."""
        space = self.inner.action_space
        if isinstance(space, gym.spaces.Text):
            return action, None
        found = re.search(r"-?\d+", action)
        if found is None or not space.contains(int(found.group())):
            return None, f"Invalid action: {self.actions}"
        return int(found.group()), None

    def act(self, action: str):
        parsed, problem = self.parse(action)
        if problem:
            return [Message("user", problem)], 0.0, False, {"invalid": problem}
        self.observation, reward, terminated, truncated, info = self.inner.step(parsed)
        self.total += float(reward)
        done = terminated or truncated
        result = {"reward_components": {"return": self.total}} if done else {}
        if truncated:
            result["reason"] = "the Gymnasium env truncated the episode"
        return [Message("user", self.text(self.observation))], float(reward), done, result

    def solver_inputs(self) -> tuple:
        return self.inner, self.observation

    def close(self) -> None:
        self.inner.close()


def frozen_lake_solver(env: gym.Env, observation: Any) -> int:
    """The first move of a shortest safe path to the goal of a (non-slippery) FrozenLake map, by BFS."""
    desc = env.unwrapped.desc.astype(str)
    rows, cols = desc.shape
    moves = {0: (0, -1), 1: (1, 0), 2: (0, 1), 3: (-1, 0)}  # left, down, right, up
    start = divmod(int(observation), cols)
    first: dict[tuple[int, int], int | None] = {start: None}
    queue = [start]
    for r, c in queue:
        if desc[r, c] == "G":
            return first[(r, c)]
        for action, (dr, dc) in moves.items():
            nxt = (r + dr, c + dc)
            if 0 <= nxt[0] < rows and 0 <= nxt[1] < cols and nxt not in first and desc[nxt] != "H":
                first[nxt] = action if first[(r, c)] is None else first[(r, c)]
                queue.append(nxt)
    raise ValueError("no safe path to the goal")
