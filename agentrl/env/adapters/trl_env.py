"""Any agentrl tool env as a TRL environment: `GRPOTrainer(environment_factory=trl_environment(ID), ...)`.

TRL (>= 1.16) makes one instance per rollout, calls `reset(**row)` with the dataset row, offers every public
method as a tool (schema from its type hints and Google-style docstring), appends each method's return value
as the tool's response, and reads `get_reward()` at the end. Here each tool method writes the env's own tool
call (`env.parser.format_call`) and steps the env with it, so the env's parsing, tools, limits and scorer run
as in agentrl; the response is the env's observation. `trl_dataset(ID, ...)` gives the rows: the env's first
messages as the prompt, and the task id that `reset` replays.

What does not carry over: TRL renders and parses the tool calls itself, with the model's chat template, so
an env that reads another action format (Search-R1 tags, ReAct) or ends on a final-answer tag rather than a
tool call (the math env) gets no reward here; tool envs that end with a tool (`answer`, `submit`, `done`) do.
"""

from __future__ import annotations

import inspect
from typing import Any

from agentrl.env.api import ToolEnv
from agentrl.env.registry import make
from agentrl.types import ToolCall


def trl_environment(env_id: str, **env_kwargs: Any) -> type:
    """A class for TRL's `environment_factory`, playing `env_id` (made with `env_kwargs`)."""
    probe = make(env_id, **env_kwargs)
    if not isinstance(probe, ToolEnv):
        raise TypeError(f"{env_id} is not a tool env ({type(probe).__name__}); TRL's environments act through tools")
    tasks = {t.id: t for t in probe.tasks}

    def __init__(self) -> None:
        self.env, self.reward, self.done = make(env_id, **env_kwargs), 0.0, False

    def reset(self, **row: Any) -> None:
        self.env.reset(seed=int(row.get("seed", 0)), options={"task": tasks[row["task_id"]]})
        self.reward, self.done = 0.0, False

    def get_reward(self) -> float:
        return self.reward

    def play(self, name: str, arguments: dict[str, Any]) -> str:
        if self.done:
            return "The episode is over."
        obs, reward, terminated, truncated, info = self.env.step(self.env.parser.format_call(ToolCall(name, arguments)))
        self.reward += reward
        self.done = terminated or truncated
        return "\n".join(m.content for m in obs) or info.get("detail", "The episode is over.")

    methods = {"__init__": __init__, "reset": reset, "get_reward": get_reward, "_play": play,
               "__doc__": f"agentrl's {env_id} for TRL's environment_factory."}
    for name in probe.toolset.names:
        methods[name] = _tool_method(name, probe.toolset.get(name).fn)
    probe.close()
    return type(f"TRL_{env_id.replace('/', '_').replace('-', '_')}", (), methods)


def _tool_method(name: str, fn) -> Any:
    """A method with `fn`'s signature and docstring (TRL builds the tool's schema from them) that plays the
    call in the env."""
    signature = inspect.signature(fn)

    def method(self, *args: Any, **kwargs: Any) -> str:
        bound = signature.bind(*args, **kwargs)
        return self._play(name, dict(bound.arguments))

    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    method.__name__ = method.__qualname__ = name
    method.__doc__ = fn.__doc__
    method.__annotations__ = dict(getattr(fn, "__annotations__", {}))
    method.__signature__ = signature.replace(parameters=[self_param, *signature.parameters.values()])
    return method


def trl_dataset(env_id: str, split: str = "train", n: int | None = None, seed: int = 0,
                **env_kwargs: Any) -> list[dict]:
    """Rows for TRL: the env's first messages as the prompt, and the task id and seed that `reset` replays."""
    env = make(env_id, split=split, **env_kwargs)
    rows = []
    for task in list(env.tasks)[:n]:
        messages = env.first_messages(task)
        rows.append({"prompt": [{"role": m.role, "content": m.content} for m in messages], "task_id": task.id,
                     "seed": seed})
    env.close()
    return rows
