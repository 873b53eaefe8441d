"""The `agentrl` command line (typer): `rollout` and `train` here, the other commands from their modules. Heavy
imports happen inside commands so `--help` stays fast."""

from __future__ import annotations

import asyncio
import faulthandler
import json
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from agentrl.cli import evaluate
from agentrl.cli.common import (CHAT_TEMPLATE_HELP, console, given, make_or_exit, missing_directory, parse_sets,
                                progress_bar)
from agentrl.cli.doctor import doctor
from agentrl.cli.envs import envs_app, sandbox_app, swe_app
from agentrl.cli.model import model_app
from agentrl.cli.serve import serve_app

app = typer.Typer(help="Train tool-using LLM agents with RL.", no_args_is_help=True,
                  rich_markup_mode=None)
for name, group in (("envs", envs_app), ("model", model_app), ("serve", serve_app), ("sandbox", sandbox_app),
                    ("swe", swe_app)):
    app.add_typer(group, name=name)
app.command()(doctor)


@app.command()
def rollout(
    config: Optional[Path] = typer.Option(None, help="TOML recipe (a RolloutJob); options below override it."),
    env: Optional[str] = typer.Option(None, help="Environment id, e.g. math/arith-v0."),
    model: Optional[str] = typer.Option(None, help="Model directory or hub name."),
    chat_template: Optional[str] = typer.Option(None, help=CHAT_TEMPLATE_HELP),
    engine: Optional[str] = typer.Option(None, help="transformers (in-process, default) or vllm."),
    vllm_url: Optional[str] = typer.Option(None, help="Attach to a running vLLM server (`agentrl serve policy`)."),
    n: Optional[int] = typer.Option(None, help="Number of tasks [default: 64]."),
    out: Optional[Path] = typer.Option(None, help="Trajectories are written here as JSONL, as they finish."),
    group_size: Optional[int] = typer.Option(None, help="Samples per task (same env seed) [default: 1]."),
    split: Optional[str] = typer.Option(None, help="Task split [default: train]."),
    concurrency: Optional[int] = typer.Option(None, help="Episodes in flight [default: 32]."),
    max_tokens: Optional[int] = typer.Option(None, help="Max sampled tokens per turn [default: 256]."),
    max_total_tokens: Optional[int] = typer.Option(None, help="Max tokens per episode, prompt included."),
    temperature: Optional[float] = typer.Option(None, help="Sampling temperature [default: 1.0]."),
    seed: Optional[int] = typer.Option(None, help="Seeds env resets and sampling [default: 0]."),
    ray_address: Optional[str] = typer.Option(None, help="Run the envs on this Ray cluster ('auto' for the local "
                                                         "node's); the recipe's [ray] sets the rest."),
) -> None:
    """Run episodes of an env with a model and write exact-token trajectories as JSONL.

    Example: agentrl rollout --env math/arith-v0 --model ~/.cache/agentrl/models/smollm2-135m-instruct --n 8
    """
    from agentrl.cli.jobs import RolloutJob
    from agentrl.config import ConfigError, load_config
    from agentrl.eval.metrics import summarize
    from agentrl.models.tokenizer import load_tokenizer
    from agentrl.policy.backends import open_policy
    from agentrl.renderer import Renderer
    from agentrl.rollout.engine import RolloutEngine
    from agentrl.rollout.jsonl import JsonlWriter
    from agentrl.rollout.ray_pool import env_factory

    overrides = given(env=env, model=model, chat_template=chat_template, n=n, out=str(out) if out else None,
                       split=split, rollout=given(
        group_size=group_size, concurrency=concurrency, max_total_tokens=max_total_tokens, seed=seed,
        sampling=given(max_tokens=max_tokens, temperature=temperature)),
        engine=given(kind="vllm" if vllm_url else engine, url=vllm_url), ray=given(address=ray_address))
    try:
        job = load_config(RolloutJob, config, overrides)
    except ConfigError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(2)
    probe = make_or_exit(job.env, split=job.split, **job.env_kwargs)
    tasks = list(probe.tasks)[:job.n]
    if len(tasks) < job.n:
        console.print(f"[yellow]{job.env} has only {len(tasks)} {job.split} tasks; running those.[/]")
    policy = open_policy(job.model, job.engine)
    make_split = env_factory(job.env, job.env_kwargs, job.ray)
    renderer = Renderer(load_tokenizer(job.model, job.chat_template))
    runner = RolloutEngine(lambda: make_split(job.split), policy, renderer, job.rollout)
    with runner, progress_bar("rollout") as bar, JsonlWriter(job.out) as writer:
        progress = bar.add_task("episodes", total=len(tasks) * job.rollout.group_size)

        def done(trajectory):
            writer.write(trajectory)  # every segment of an episode; the bar counts episodes
            bar.advance(progress, int(trajectory.logs.get("segment", 0) == 0))

        start = time.perf_counter()
        groups = asyncio.run(runner.run(tasks, on_episode=done))
        seconds = time.perf_counter() - start
    asyncio.run(policy.close())
    summary = summarize([t for g in groups for t in g.trajectories], probe.max_reward, seconds)
    table = Table("metric", "value", title=f"{job.env} · {summary['episodes']} episodes → {job.out}")
    for key, value in summary.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else json.dumps(value))
    console.print(table)


@app.command()
def train(recipe: Path = typer.Argument(..., help="TOML recipe: a TrainJob (see recipes/)."),
          model: Optional[str] = typer.Option(None, help="Override the recipe's model."),
          out_dir: Optional[str] = typer.Option(None, help="Override the recipe's output directory."),
          steps: Optional[int] = typer.Option(None, help="Override the RL loop's steps (in its method's table, "
                                                         "e.g. grpo.steps)."),
          ray_address: Optional[str] = typer.Option(None, help="Run the envs on this Ray cluster ('auto': the "
                                                               "local node's); the recipe's [ray] sets the rest."),
          set_: list[str] = typer.Option([], "--set", help="Override any recipe key: KEY=VALUE with a dotted key "
                                         "and a TOML value, e.g. --set grpo.lr=1e-4 --set eval.n=16; a list's "
                                         "element by index: --set sft.1.episodes=64. Repeatable."),
          unset: list[str] = typer.Option([], "--unset", help="Remove a recipe key or table, so that its default "
                                          "applies, e.g. --unset grpo.correction. Repeatable."),
          dry_run: bool = typer.Option(False, "--dry-run", help="Validate the recipe, place the engine and the "
                                       "trainer, estimate memory per device, refuse what cannot work; print the "
                                       "resolved job; run nothing."),
          gpus: Optional[int] = typer.Option(None, help="--dry-run: plan for this many GPUs [default: the visible]."),
          gpu_memory_gib: float = typer.Option(80.0, help="--dry-run with --gpus: each GPU's memory in GiB."),
          model_config: Optional[str] = typer.Option(None, help="--dry-run: a folder with the model's config.json "
                                                     "[default: the recipe's model]; offline, a saved copy."),
          ranks: Optional[int] = typer.Option(None, min=1, help="--dry-run: plan for this many trainer ranks (FSDP "
                                              "under torchrun) [default: torchrun's WORLD_SIZE, else 1]."),
          tokens_per_s: Optional[float] = typer.Option(None, min=0.001, help="--dry-run: a throughput (sampled "
                                                       "tokens per second of a whole step, as a run's metrics give "
                                                       "it) to estimate the step time from [default: measured]."),
          ) -> None:
    """SFT warm start (optional) → held-out eval → RL (GRPO, PPO, tandem, tango or DPO) → held-out eval;
    resumes from the latest checkpoint.

    Example: agentrl train recipes/cpu_demo_train.toml --set grpo.steps=5 --out-dir runs/try
    """
    from agentrl.config import ConfigError, load_config, merge
    from agentrl.env.api import EnvNotReady
    from agentrl.trainers.checkpoint import CheckpointError
    from agentrl.trainers.metrics import EveryEpisodeFailed, NonFiniteLoss
    from agentrl.trainers.methods import METHODS
    from agentrl.trainers.job.pipeline import run
    from agentrl.trainers.job.recipe import TrainJob

    try:
        overrides = merge(parse_sets(set_), given(model=model, out_dir=out_dir, ray=given(address=ray_address)))
        job = load_config(TrainJob, recipe, overrides, unset)
        if steps is not None:  # the steps of the method's loop, [grpo] or [ppo] (DPO has none: an error)
            job = load_config(TrainJob, recipe, merge(overrides, {METHODS[job.method].settings: {"steps": steps}}),
                              unset)
    except ConfigError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(2)
    if missing_directory(job.model) and not (dry_run and model_config):  # a dry run may plan from a saved config
        console.print(f"[red]No model directory at {job.model!r}. A recipe's model is a directory that an earlier step "
                      "made (the research recipes start from recipes/cpu_math_warmstart_train.toml's "
                      "runs/math-warmstart/sft_model), `agentrl model init DIR` (the tiny model) or `agentrl model "
                      "fetch NAME`; or a hub name.[/]")
        raise typer.Exit(2)
    if dry_run:
        _dry_run(job, gpus, gpu_memory_gib, model_config, ranks, tokens_per_s)
        return
    make_or_exit(job.env, **job.env_kwargs)
    # `kill -USR1 PID` prints every thread's stack to stderr (fd 2, whatever replaced sys.stderr) and the job goes
    # on: where a stuck rank waits
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    try:
        summary = run(job, log=console.print)
    except (CheckpointError, EnvNotReady, EveryEpisodeFailed, NonFiniteLoss) as e:  # the message says all there is
        console.print(f"[red]{e}[/]")
        raise typer.Exit(1)
    if "before" in summary and "after" in summary:
        before, after = summary["before"], summary["after"]
        b, a = before["success"], after["success"]
        errors = (f"; episodes ended in error, not counted: {before['errors']} before, {after['errors']} after"
                  if before.get("errors") or after.get("errors") else "")
        console.print(f"[bold]held-out success: {b:.3f} → {a:.3f} ({100 * (a - b):+.1f} points){errors}[/]")
    console.print(f"metrics, checkpoints and reward_curve.png in {job.out_dir}")




def _dry_run(job, gpus: int | None, gpu_memory_gib: float, model_config: str | None, ranks: int | None,
             tokens_per_s: float | None) -> None:
    """Print the resolved job (what OUT/job.json would hold), where its parts would run and their memory; exit 2,
    with each problem and its fix, if it cannot work."""
    from agentrl.env.registry import spec
    from agentrl.trainers.job.dry_run import Hardware, describe, plan_for
    from agentrl.trainers.job.pipeline import job_record

    try:
        spec(job.env)
    except KeyError as e:
        console.print(f"[red]{e.args[0]}[/]")
        raise typer.Exit(2)
    console.print_json(data=job_record(job))
    try:
        the_plan = plan_for(job, Hardware(gpus, gpu_memory_gib) if gpus is not None else None, model_config, ranks,
                            tokens_per_s)
    except ValueError as e:  # no model config to plan from
        console.print(f"[red]{e}[/]")
        raise typer.Exit(2)
    table = Table("part", "where / memory", title=f"{job.model} · {job.method} · dry run")
    for row in describe(the_plan):
        table.add_row(*row)
    console.print(table)
    for problem in the_plan.problems:
        console.print(f"[red]✗[/] {problem}")
    if the_plan.problems:
        raise typer.Exit(2)
    fits = "validates, but may not fit (memory, above)" if "memory" in the_plan.notes else "validates and fits"
    console.print(f"[green]✓[/] the recipe {fits}; nothing was run")


for name, command in (("eval", evaluate.eval_suite), ("report", evaluate.report), ("compare", evaluate.compare),
                      ("baselines", evaluate.baselines),
                      ("attempts", evaluate.attempts), ("suites", evaluate.suites_list)):
    app.command(name)(command)


if __name__ == "__main__":
    app()
