"""What the CLI's commands share: the console, option help, progress bars, and turning bad input into a clear exit."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

console = Console()
CHAT_TEMPLATE_HELP = ("Chat template in place of the model's own: 'chatml-tools' (the project's ChatML with Hermes "
                      "tool calls, for ChatML models without tools, e.g. SmolLM2) or a Jinja file.")
KWARGS_HELP = 'Env keyword arguments as JSON, e.g. \'{"environment": "my-vf-env"}\' for verifiers/env-v0.'


def progress_bar(label: str) -> Progress:
    """A progress bar for long work: LABEL, the bar, done/total, time elapsed."""
    return Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console)


def given(**options):
    """The options the user gave (not None, not empty), as a nested override dict."""
    return {k: v for k, v in options.items() if v is not None and v != {}}


def make_or_exit(env_id: str, **kwargs):
    """`agentrl.make(env_id, **kwargs)`, or exit 2 saying what is wrong: an unknown id, a missing argument."""
    from agentrl.env.registry import make

    try:
        return make(env_id, **kwargs)
    except KeyError as e:
        console.print(f"[red]{e.args[0]}[/]")
        raise typer.Exit(2)
    except TypeError as e:  # e.g. a required argument (openenv/remote-v0's url) not given
        if "argument" not in str(e):
            raise
        console.print(f"[red]{env_id}: {e}. Give it with --kwargs '{{\"NAME\": VALUE}}' (or in a recipe's "
                      "\\[env_kwargs]).[/]")
        raise typer.Exit(2)


def missing_directory(model: str) -> bool:
    """Whether `model` names a local directory (a path, not a hub name `org/name`) that does not exist."""
    local = model.startswith((".", "/", "~")) or model.count("/") >= 2
    return local and not Path(os.path.expanduser(model)).is_dir()


def parse_sets(assignments: list[str]) -> dict:
    """`["grpo.lr=1e-4", "eval.n=16"]` as nested overrides; a value is TOML (a bare word is a string)."""
    import tomllib

    from agentrl.config import ConfigError

    out: dict = {}
    for assignment in assignments:
        key, sep, text = assignment.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. --set grpo.lr=1e-4")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text  # a bare word: `--set env=math/arith-v0`
        *parents, leaf = key.strip().split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out
