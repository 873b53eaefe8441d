"""Any agentrl env behind an OpenEnv server (`agentrl serve env ID`), so that other trainers can use ours.

It speaks OpenEnv's protocol with OpenEnv's own server (`openenv.core.env_server.create_app`): a WebSocket
session per episode at `/ws` (`reset`, `step`, `state`, `close` messages), with up to `max_sessions` at once,
each with its own env instance; `/health`, `/schema` and `/metadata` as usual. (OpenEnv's plain HTTP `/reset`
and `/step` make a fresh env per request, so multi-turn episodes need the WebSocket, as OpenEnv's clients use.)

    action       {"text": "<the assistant's turn>"}
    observation  {"messages": [{"role", "content", "tool_calls", "tool_call_id", "name"}, ...],
                  "done": bool, "reward": float | null, "metadata": {task_id, tools (at reset), info (at step)}}
    reset        {"seed": int, "task_index": int | null, "split": str | null}

The rest of an agentrl env's API, for `agentrl.env.remote.RemoteEnv` (the trainer's side of an env in its own
virtualenv), as plain HTTP:

    GET  /agentrl/env?split=S          {version, max_reward, max_turns, tools, tasks: [{id, data, difficulty}]}
    POST /agentrl/check                {split, n} -> {problems}: `check_instance` run here
    POST /agentrl/demonstration        {split, task_index, seed, error_rate} -> {actions}

A step's metadata also carries the env's reading of the action (`assistant`, a chat message), which the trainer
renders as is. `python -m agentrl.env.adapters.openenv_server --entry-point M:C --kwargs JSON` serves an env class
on a free port and prints `{"port": N}` (or writes N to `--port-file`) once it listens: how an env in its own
virtualenv is served (`agentrl.env.remote`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from fastapi import HTTPException
from openenv.core.env_server import Action, Environment, Observation, State, create_app

from agentrl.env.api import TextEnv
from agentrl.env.registry import EnvSpec, check_instance, make


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
    return build_app_for(env_id, lambda **kwargs: make(env_id, **kwargs), max_sessions, **env_kwargs)


def build_app_for(name: str, make_env: Callable[..., TextEnv], max_sessions: int = 64, **env_kwargs: Any):
    """The FastAPI app of an OpenEnv server for the envs `make_env(**env_kwargs)` makes, under `name`."""
    make_env(**env_kwargs).close()  # fail now, with the factory's message, not in the first session

    class AgentrlEnvironment(Environment[TextAction, MessagesObservation, State]):
        SUPPORTS_CONCURRENT_SESSIONS = True  # one env instance per WebSocket session

        def __init__(self):
            super().__init__()
            self.env = make_env(**env_kwargs)
            self._state = State(episode_id=str(uuid.uuid4()), step_count=0)

        def reset(self, seed: int | None = None, episode_id: str | None = None, task_index: int | None = None,
                  split: str | None = None, **kwargs: Any) -> MessagesObservation:
            if split is not None and split != self.env.split:
                self.env.close()
                self.env = make_env(**{**env_kwargs, "split": split})
            options = {"task": self.env.tasks[task_index]} if task_index is not None else None
            obs, info = self.env.reset(seed=seed, options=options)
            self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
            return MessagesObservation(messages=_messages(obs), done=False, reward=None,
                                       metadata={"task_id": info["task_id"], "tools": _json_safe(info["tools"])})

        def step(self, action: TextAction, **kwargs: Any) -> MessagesObservation:
            obs, reward, terminated, truncated, info = self.env.step(action.text)
            self._state.step_count += 1
            assistant = info.pop("assistant")  # agentrl's own reading of the action
            return MessagesObservation(messages=_messages(obs), done=terminated or truncated, reward=reward,
                                       metadata={"terminated": terminated, "truncated": truncated,
                                                 "info": _json_safe(info), "assistant": _messages([assistant])[0]})

        @property
        def state(self) -> State:
            return self._state

        def close(self) -> None:
            self.env.close()

    app = create_app(AgentrlEnvironment, TextAction, MessagesObservation, env_name=name,
                     max_concurrent_envs=max_sessions)
    _add_agentrl_routes(app, make_env, env_kwargs)
    return app


def _add_agentrl_routes(app, make_env: Callable[..., TextEnv], env_kwargs: dict[str, Any]) -> None:
    """The `/agentrl/*` routes (the module's doc): the env's static side, from one instance per split."""
    envs: dict[str, TextEnv] = {}

    def env_of(split: str) -> TextEnv:
        if split not in envs:
            envs[split] = make_env(**{**env_kwargs, "split": split})
        return envs[split]

    @app.get("/agentrl/env")
    def describe(split: str = "train") -> dict[str, Any]:
        env = env_of(split)
        return _json_safe({"version": metadata.version("agentrl"), "max_reward": env.max_reward,
                           "max_turns": env.max_turns, "tools": env.tool_schemas,
                           "tasks": [{"id": t.id, "data": t.data, "difficulty": env.difficulty(t)} for t in env.tasks]})

    @app.post("/agentrl/check")
    def check(body: dict[str, Any]) -> dict[str, Any]:
        return {"problems": check_instance(make_env(**{**env_kwargs, "split": body["split"]}), int(body["n"]))}

    @app.post("/agentrl/demonstration")
    def demonstration(body: dict[str, Any]) -> dict[str, Any]:
        env = env_of(body["split"])
        actions = env.demonstration(env.tasks[body["task_index"]], random.Random(body["seed"]), body["error_rate"])
        if not isinstance(actions, (list, tuple)):  # a generator reads the live episode, which is not here
            raise HTTPException(400, f"{type(env).__name__}'s demonstrations depend on the episode they play "
                                     "(a generator): they cannot be read from another process")
        return {"actions": [str(a) for a in actions]}


def main(argv: list[str] | None = None) -> None:
    """Serve an env class (`--entry-point module:Class`) on a free port of 127.0.0.1."""
    import uvicorn

    from agentrl.system.tcp import listening_socket

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--entry-point", required=True)
    parser.add_argument("--kwargs", default="{}", help="the env's keyword arguments, as JSON")
    parser.add_argument("--name", default="")
    parser.add_argument("--max-sessions", type=int, default=64)
    parser.add_argument("--port-file", help="where to write the port once listening (else: stdout)")
    args = parser.parse_args(argv)
    cls = EnvSpec(args.name or args.entry_point, args.entry_point).load()
    app = build_app_for(args.name or args.entry_point, cls, args.max_sessions, **json.loads(args.kwargs))
    sock = listening_socket()
    sock.listen(128)  # connections wait in the backlog until uvicorn accepts them
    port = sock.getsockname()[1]
    if args.port_file:
        Path(args.port_file + ".tmp").write_text(f"{port}\n")
        os.replace(args.port_file + ".tmp", args.port_file)  # whole, or not there
    else:
        print(json.dumps({"port": port}), flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
