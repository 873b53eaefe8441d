"""The side of the NeMo Gym adapter that runs in NeMo Gym's own virtualenv (`nemo_gym_env.py` starts it by path: it
imports nothing of agentrl, whose pins NeMo Gym's cannot live beside). One command per process, its JSON arguments
as argv[2], its result as one JSON line on stdout.

    rows {"server"}                     -> the resources server's example rows (its data/example.jsonl)
    run  {"server", "row", "base_url"}  -> what NeMo Gym's `/run` returns for the row: {"reward", ...}

`run` is NeMo Gym's own episode: the resources server, its `simple_agent` and the `openai_model` adapter (the
Responses API at `base_url`, a gateway session), each a FastAPI app on a free local port in this one process and
event loop, configured as NeMo Gym's CLI configures its servers (`NEMO_GYM_CONFIG_DICT`), without the CLI's head
server and Ray. The agent seeds the session, loops model call → tool calls until a reply calls no tool, and asks
the resources server's `/verify` for the reward.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_class(module: str) -> type:
    """The one server class a NeMo Gym `app.py` defines (a subclass of its base server types)."""
    from nemo_gym.server_utils import SimpleServer

    loaded = importlib.import_module(module)
    [cls] = [c for c in vars(loaded).values()
             if isinstance(c, type) and issubclass(c, SimpleServer) and c.__module__ == loaded.__name__]
    return cls


def rows(args: dict[str, Any]) -> list[dict[str, Any]]:
    import resources_servers

    path = Path(resources_servers.__path__[0]) / args["server"] / "data" / "example.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def run(args: dict[str, Any]) -> dict[str, Any]:
    server, agent, model = f"{args['server']}_resources_server", "simple_agent", "policy_model"
    ports = {name: free_port() for name in (server, agent, model)}
    config = {
        "head_server": {"host": HOST, "port": free_port()},  # never started: the servers find each other by config
        server: {"resources_servers": {args["server"]: {"entrypoint": "app.py", "host": HOST, "port": ports[server],
                                                        "domain": "other"}}},
        agent: {"responses_api_agents": {"simple_agent": {
            "entrypoint": "app.py", "host": HOST, "port": ports[agent],
            "resources_server": {"type": "resources_servers", "name": server},
            "model_server": {"type": "responses_api_models", "name": model}}}},
        model: {"responses_api_models": {"openai_model": {
            "entrypoint": "app.py", "host": HOST, "port": ports[model], "openai_base_url": args["base_url"],
            "openai_api_key": "agentrl", "openai_model": "policy"}}},
    }
    import yaml

    os.environ["NEMO_GYM_CONFIG_DICT"] = yaml.safe_dump(config)  # how NeMo Gym hands its servers their config
    import aiohttp
    import uvicorn
    from nemo_gym.config_types import BaseServerConfig
    from nemo_gym.server_utils import ServerClient
    from omegaconf import OmegaConf

    def build(name: str, module: str) -> uvicorn.Server:
        cls = server_class(module)
        [(_, settings)] = list(config[name].values())[0].items()
        client = ServerClient(head_server_config=BaseServerConfig(**config["head_server"]),
                              global_config_dict=OmegaConf.create(config))
        instance = cls(config=cls.model_fields["config"].annotation.model_validate({**settings, "name": name}),
                       server_client=client)
        app = instance.setup_webserver()
        instance.setup_exception_middleware(app)
        return uvicorn.Server(uvicorn.Config(app, host=HOST, port=settings["port"], log_level="warning"))

    servers = [build(server, f"resources_servers.{args['server']}.app"),
               build(agent, "responses_api_agents.simple_agent.app"),
               build(model, "responses_api_models.openai_model.app")]
    serving = [asyncio.create_task(s.serve()) for s in servers]
    try:
        while not all(s.started for s in servers):
            if any(t.done() for t in serving):
                [t.result() for t in serving if t.done()]  # a server that failed to start: its error
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as http:  # one session: one episode's cookies
            async with http.post(f"http://{HOST}:{ports[agent]}/run", json=args["row"]) as response:
                if response.status != 200:
                    raise RuntimeError(f"NeMo Gym's /run answered {response.status}: {(await response.text())[:1000]}")
                result = await response.json()
    finally:
        for s in servers:
            s.should_exit = True
        await asyncio.gather(*serving, return_exceptions=True)
    return {k: v for k, v in result.items() if k != "responses_create_params"}


def main() -> None:
    command, args = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps(rows(args) if command == "rows" else asyncio.run(run(args))))


if __name__ == "__main__":
    main()
