"""`agentrl envs ...`, `agentrl sandbox ...`, `agentrl swe ...`: the environments and what they run in."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from agentrl.cli.common import KWARGS_HELP, console, make_or_exit

envs_app = typer.Typer(help="List, inspect and check environments.", no_args_is_help=True,
                       rich_markup_mode=None)
sandbox_app = typer.Typer(help="Docker sandboxes for code envs.", no_args_is_help=True,
                          rich_markup_mode=None)
swe_app = typer.Typer(help="SWE tasks.", no_args_is_help=True,
                      rich_markup_mode=None)


@envs_app.command("list")
def envs_list(as_json: bool = typer.Option(False, "--json", help="Plain JSON (id, entry point, defaults) for scripts.")
              ) -> None:
    """Registered environment ids (ours and installed plugins').

    Example: agentrl envs list --json
    """
    from agentrl.env.registry import registry

    if as_json:
        typer.echo(json.dumps([{"id": spec.id, "entry_point": spec.entry_point, "kwargs": spec.kwargs}
                               for spec in registry().values()], indent=1))
        return
    table = Table("id", "entry point", "defaults")
    for spec in registry().values():
        table.add_row(spec.id, spec.entry_point, json.dumps(spec.kwargs) if spec.kwargs else "")
    console.print(table)


@envs_app.command("show")
def envs_show(env_id: str, split: str = "train", kwargs: str = typer.Option("{}", help=KWARGS_HELP)) -> None:
    """The tools and the first messages of an env's first task.

    Example: agentrl envs show search/r1-v0
    """
    env = make_or_exit(env_id, split=split, **json.loads(kwargs))
    obs, info = env.reset(seed=0)
    console.print(f"[bold]{env_id}[/] ({type(env).__name__}), {len(env.tasks)} {split} tasks")
    console.print_json(data=info["tools"])
    for m in obs:
        console.print(f"[bold]{m.role}[/]: {m.content}")
    env.close()


@envs_app.command("check")
def envs_check(env_id: str, n_tasks: int = typer.Option(8, help="Tasks whose gold solution is validated."),
               kwargs: str = typer.Option("{}", help=KWARGS_HELP)) -> None:
    """Gymnasium's env checker plus the env's own validate() (gold solutions must get the maximum reward).

    Example: agentrl envs check math/arith-v0
    """
    from agentrl.env.registry import check

    env_kwargs = json.loads(kwargs)
    env = make_or_exit(env_id, **env_kwargs)
    checked = min(n_tasks, len(env.tasks))
    env.close()
    problems = check(env_id, n_tasks=n_tasks, **env_kwargs)
    for p in problems:
        console.print(f"[red]✗[/] {p}")
    if problems:
        raise typer.Exit(1)
    console.print(f"[green]✓[/] {env_id}: check_env passed; gold solutions of {checked} tasks get the maximum reward")


@envs_app.command("attack")
def envs_attack(env_id: str, n_tasks: int = typer.Option(2, help="Tasks each attack plays."),
                kwargs: str = typer.Option("{}", help=KWARGS_HELP),
                as_json: bool = typer.Option(False, "--json", help="Plain JSON (attack, held, detail) for scripts.")
                ) -> None:
    """Run the project's adversarial policies against an env's grader and reset: forged reports of success,
    outputs that would turn a failure into an error, state left for the next episode. Exit 1 when one got through.

    Example: agentrl envs attack search/tools-v0
    """
    from dataclasses import asdict

    from agentrl.env.attack import attack
    from agentrl.env.registry import make

    env_kwargs = json.loads(kwargs)
    make_or_exit(env_id, **env_kwargs).close()
    findings = attack(lambda: make(env_id, **env_kwargs), n_tasks)
    if as_json:
        typer.echo(json.dumps([asdict(f) for f in findings], indent=1))
    else:
        for f in findings:
            console.print(f"[green]held[/] {f.attack}: {escape(f.detail)}" if f.held else
                          f"[red]hole[/] {f.attack}: {escape(f.detail)}")
    if not all(f.held for f in findings):
        raise typer.Exit(1)


@sandbox_app.command("build")
def sandbox_build(base_image: str = typer.Option("agentrl/base:bookworm", help="Image to build FROM.")) -> None:
    """Build the Python sandbox image (idempotent). The default base image is built offline from Debian
    packages by containers/build-base.sh; any Debian/Ubuntu image with python3 works.

    Example: agentrl sandbox build
    """
    from agentrl.tools.sandbox import SandboxError
    from agentrl.tools.sandbox.docker_runtime import build_image

    try:
        console.print(f"sandbox image: {build_image(base_image)}")
    except SandboxError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(1)


@sandbox_app.command("clean")
def sandbox_clean() -> None:
    """Remove sandbox containers whose owning process is gone (normally none: they end with it).

    Example: agentrl sandbox clean
    """
    from agentrl.tools.sandbox.docker_runtime import cleanup_stale

    console.print(f"removed {cleanup_stale()} stale sandbox containers")


@swe_app.command("generate")
def swe_generate(per_repo: int = typer.Option(20, help="Bugs to keep per repository."),
                 seed: int = typer.Option(0, help="Seed of the order in which bug sites are tried."),
                 out: Optional[Path] = typer.Option(None, help="Instances JSONL [default: the swe/generated-v0 one]."),
                 force: bool = typer.Option(False, help="Generate again even if the instances and images exist.")
                 ) -> None:
    """Generate SWE tasks offline: inject bugs into real repositories (pinned sdists) with libcst and keep
    those that make passing tests fail. Deterministic; needs Docker (`make setup-docker`).

    Example: agentrl swe generate --per-repo 20
    """
    from agentrl.envs.swe.generate import INSTANCES, generate, up_to_date
    from agentrl.tools.sandbox import SandboxError

    if not force and up_to_date(out or INSTANCES, per_repo, seed):
        console.print(f"{out or INSTANCES} is up to date (--force to generate again)")
        return
    try:
        instances = generate(out or INSTANCES, per_repo=per_repo, seed=seed, log=console.print)
    except SandboxError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(1)
    splits = {}
    for i in instances:
        splits[i["split"]] = splits.get(i["split"], 0) + 1
    console.print(f"{len(instances)} instances ({', '.join(f'{k} {v}' for k, v in sorted(splits.items()))}) "
                  f"→ {out or INSTANCES}")
