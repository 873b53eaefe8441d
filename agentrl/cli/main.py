"""The `agentrl` command line (typer). Heavy imports happen inside commands so `--help` stays fast."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Optional
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from agentrl.cli.model import model_app
from agentrl.cli.serve import serve_app

app = typer.Typer(help="Train tool-using LLM agents with RL.", no_args_is_help=True)
envs_app = typer.Typer(help="List, inspect and check environments.", no_args_is_help=True)
app.add_typer(envs_app, name="envs")
app.add_typer(model_app, name="model")
app.add_typer(serve_app, name="serve")
sandbox_app = typer.Typer(help="Docker sandboxes for code envs.", no_args_is_help=True)
app.add_typer(sandbox_app, name="sandbox")
swe_app = typer.Typer(help="SWE tasks.", no_args_is_help=True)
app.add_typer(swe_app, name="swe")
console = Console()
CHAT_TEMPLATE_HELP = ("Chat template in place of the model's own: 'chatml-tools' (the project's ChatML with Hermes "
                      "tool calls, for ChatML models without tools, e.g. SmolLM2) or a Jinja file.")


@envs_app.command("list")
def envs_list() -> None:
    """Registered environment ids (ours and installed plugins')."""
    from agentrl.env.registry import registry

    table = Table("id", "entry point", "defaults")
    for spec in registry().values():
        table.add_row(spec.id, spec.entry_point, json.dumps(spec.kwargs) if spec.kwargs else "")
    console.print(table)


KWARGS_HELP = 'Env keyword arguments as JSON, e.g. \'{"environment": "my-vf-env"}\' for verifiers/env-v0.'


@envs_app.command("show")
def envs_show(env_id: str, split: str = "train", kwargs: str = typer.Option("{}", help=KWARGS_HELP)) -> None:
    """The tools and the first messages of an env's first task."""
    env = _make_or_exit(env_id, split=split, **json.loads(kwargs))
    obs, info = env.reset(seed=0)
    console.print(f"[bold]{env_id}[/] ({type(env).__name__}), {len(env.tasks)} {split} tasks")
    console.print_json(data=info["tools"])
    for m in obs:
        console.print(f"[bold]{m.role}[/]: {m.content}")
    env.close()


@envs_app.command("check")
def envs_check(env_id: str, n_tasks: int = typer.Option(8, help="Tasks whose gold solution is validated."),
               kwargs: str = typer.Option("{}", help=KWARGS_HELP)) -> None:
    """Gymnasium's env checker plus the env's own validate() (gold solutions must get the maximum reward)."""
    from agentrl.env.registry import check

    env_kwargs = json.loads(kwargs)
    _make_or_exit(env_id, **env_kwargs)
    problems = check(env_id, n_tasks=n_tasks, **env_kwargs)
    for p in problems:
        console.print(f"[red]✗[/] {p}")
    if problems:
        raise typer.Exit(1)
    console.print(f"[green]✓[/] {env_id}: check_env passed; gold solutions of {n_tasks} tasks get the maximum reward")


@sandbox_app.command("build")
def sandbox_build(base_image: str = typer.Option("agentrl/base:bookworm", help="Image to build FROM.")) -> None:
    """Build the Python sandbox image (idempotent). The default base image is built offline from Debian
    packages by containers/build-base.sh; any Debian/Ubuntu image with python3 works."""
    from agentrl.tools.sandbox import SandboxError
    from agentrl.tools.sandbox.docker_runtime import build_image

    try:
        console.print(f"sandbox image: {build_image(base_image)}")
    except SandboxError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(1)


@sandbox_app.command("clean")
def sandbox_clean() -> None:
    """Remove sandbox containers whose owning process is gone (normally none: they end with it)."""
    from agentrl.tools.sandbox.docker_runtime import cleanup_stale

    console.print(f"removed {cleanup_stale()} stale sandbox containers")


@swe_app.command("generate")
def swe_generate(per_repo: int = typer.Option(20, help="Bugs to keep per repository."),
                 seed: int = typer.Option(0, help="Seed of the order in which bug sites are tried."),
                 out: Optional[Path] = typer.Option(None, help="Instances JSONL [default: the swe/generated-v0 one]."),
                 force: bool = typer.Option(False, help="Generate again even if the instances and images exist.")
                 ) -> None:
    """Generate SWE tasks offline: inject bugs into real repositories (pinned sdists) with libcst and keep
    those that make passing tests fail. Deterministic; needs Docker (`make setup-docker`)."""
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
    """Run episodes of an env with a model and write exact-token trajectories as JSONL."""
    from agentrl.config import ConfigError, load_config
    from agentrl.policy.backends import open_policy
    from agentrl.rollout.ray_pool import env_factory
    from agentrl.renderer import Renderer
    from agentrl.rollout.engine import RolloutEngine
    from agentrl.rollout.jsonl import JsonlWriter
    from agentrl.cli.jobs import RolloutJob
    from agentrl.eval.metrics import summarize
    from agentrl.models.tokenizer import load_tokenizer

    overrides = _given(env=env, model=model, chat_template=chat_template, n=n, out=str(out) if out else None,
                       split=split, rollout=_given(
        group_size=group_size, concurrency=concurrency, max_total_tokens=max_total_tokens, seed=seed,
        sampling=_given(max_tokens=max_tokens, temperature=temperature)),
        engine=_given(kind="vllm" if vllm_url else engine, url=vllm_url), ray=_given(address=ray_address))
    try:
        job = load_config(RolloutJob, config, overrides)
    except ConfigError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(2)
    probe = _make_or_exit(job.env, split=job.split, **job.env_kwargs)
    tasks = list(probe.tasks)[:job.n]
    if len(tasks) < job.n:
        console.print(f"[yellow]{job.env} has only {len(tasks)} {job.split} tasks; running those.[/]")
    policy = open_policy(job.model, job.engine)
    make_split = env_factory(job.env, job.env_kwargs, job.ray)
    renderer = Renderer(load_tokenizer(job.model, job.chat_template))
    runner = RolloutEngine(lambda: make_split(job.split), policy, renderer, job.rollout)
    with Progress(TextColumn("rollout"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as bar, JsonlWriter(job.out) as writer:
        progress = bar.add_task("episodes", total=len(tasks) * job.rollout.group_size)

        def done(trajectory):
            writer.write(trajectory)
            bar.advance(progress)

        start = time.perf_counter()
        groups = asyncio.run(runner.run(tasks, on_episode=done))
        seconds = time.perf_counter() - start
    runner.close()
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
          steps: Optional[int] = typer.Option(None, help="Override the RL loop's steps (grpo.steps or ppo.steps)."),
          ray_address: Optional[str] = typer.Option(None, help="Run the envs on this Ray cluster ('auto': the "
                                                               "local node's); the recipe's [ray] sets the rest."),
          set_: list[str] = typer.Option([], "--set", help="Override any recipe key: KEY=VALUE with a dotted key "
                                         "and a TOML value, e.g. --set grpo.lr=1e-4 --set eval.n=16; a list's "
                                         "element by index: --set sft.1.episodes=64. Repeatable."),
          unset: list[str] = typer.Option([], "--unset", help="Remove a recipe key or table, so that its default "
                                          "applies, e.g. --unset grpo.correction. Repeatable."),
          dry_run: bool = typer.Option(False, "--dry-run", help="Validate the recipe, place the engine and the "
                                       "trainer, estimate memory per device, refuse what cannot work; run nothing."),
          gpus: Optional[int] = typer.Option(None, help="--dry-run: plan for this many GPUs [default: the visible]."),
          gpu_memory_gib: float = typer.Option(80.0, help="--dry-run with --gpus: each GPU's memory in GiB."),
          model_config: Optional[str] = typer.Option(None, help="--dry-run: a folder with the model's config.json "
                                                     "[default: the recipe's model]; offline, a saved copy."),
          ) -> None:
    """SFT warm start (optional) → held-out eval → RL (GRPO, PPO, tandem, tango or DPO) → held-out eval;
    resumes from the latest checkpoint."""
    from agentrl.config import ConfigError, load_config, merge
    from agentrl.trainers.checkpoint import CheckpointError
    from agentrl.trainers.metrics import NonFiniteLoss
    from agentrl.trainers.pipeline import METHODS, TrainJob, run

    try:
        overrides = merge(parse_sets(set_), _given(model=model, out_dir=out_dir, ray=_given(address=ray_address)))
        job = load_config(TrainJob, recipe, overrides, unset)
        if steps is not None:  # the steps of the method's loop, [grpo] or [ppo] (DPO has none: an error)
            job = load_config(TrainJob, recipe, merge(overrides, {METHODS[job.method].settings: {"steps": steps}}),
                              unset)
    except ConfigError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(2)
    if _missing_directory(job.model) and not (dry_run and model_config):  # a dry run may plan from a saved config
        console.print(f"[red]No model directory at {job.model!r}. A recipe's model is a directory that an earlier step "
                      "made (the research recipes start from recipes/cpu_math_warmstart_train.toml's "
                      "runs/math-warmstart/sft_model), `agentrl model init DIR` (the tiny model) or `agentrl model "
                      "fetch NAME`; or a hub name.[/]")
        raise typer.Exit(2)
    if dry_run:
        _dry_run(job, gpus, gpu_memory_gib, model_config)
        return
    _make_or_exit(job.env, **job.env_kwargs)
    try:
        summary = run(job, log=console.print)
    except (CheckpointError, NonFiniteLoss) as e:  # what the message says is all there is to know
        console.print(f"[red]{e}[/]")
        raise typer.Exit(1)
    if "before" in summary and "after" in summary:
        b, a = summary["before"]["success"], summary["after"]["success"]
        console.print(f"[bold]held-out success: {b:.3f} → {a:.3f} ({100 * (a - b):+.1f} points)[/]")
    console.print(f"metrics, checkpoints and reward_curve.png in {job.out_dir}")


def _missing_directory(model: str) -> bool:
    """Whether `model` names a local directory (a path, not a hub name `org/name`) that does not exist."""
    local = model.startswith((".", "/", "~")) or model.count("/") >= 2
    return local and not Path(os.path.expanduser(model)).is_dir()


def _dry_run(job, gpus: int | None, gpu_memory_gib: float, model_config: str | None) -> None:
    """Print where the job's parts would run and their memory; exit 2, with each problem and its fix, if it
    cannot work."""
    from agentrl.env.registry import spec
    from agentrl.trainers.dry_run import Hardware, describe, plan_for

    try:
        spec(job.env)
    except KeyError as e:
        console.print(f"[red]{e.args[0]}[/]")
        raise typer.Exit(2)
    the_plan = plan_for(job, Hardware(gpus, gpu_memory_gib) if gpus is not None else None, model_config)
    table = Table("part", "where / memory", title=f"{job.model} · {job.method} · dry run")
    for row in describe(the_plan):
        table.add_row(*row)
    console.print(table)
    for problem in the_plan.problems:
        console.print(f"[red]✗[/] {problem}")
    if the_plan.problems:
        raise typer.Exit(2)
    console.print("[green]✓[/] the recipe validates and fits; nothing was run")


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


@app.command("eval")
def eval_suite(
    suite: Optional[str] = typer.Option(None, help="A registered suite (`agentrl suites`) or a suite TOML file."),
    model: Optional[str] = typer.Option(None, help="Model directory or hub name, or the URL of a vLLM server."),
    config: Optional[Path] = typer.Option(None, help="TOML file of an EvalJob; the options below override it."),
    k: Optional[str] = typer.Option(None, help="pass@k for these k, e.g. 1,8; each task is sampled max(k) times "
                                               "[default: 1]."),
    n: Optional[int] = typer.Option(None, help="At most N tasks per suite entry."),
    out: Optional[Path] = typer.Option(None, help="Run directory [default: runs/eval/SUITE]. Rerun to resume."),
    engine: Optional[str] = typer.Option(None, help="transformers (in-process, default) or vllm (started for the "
                                                    "eval)."),
    tokenizer: Optional[str] = typer.Option(None, help="Tokenizer dir/name [default: the model's]."),
    chat_template: Optional[str] = typer.Option(None, help=CHAT_TEMPLATE_HELP),
    temperature: Optional[float] = typer.Option(None, help="[default: 0 when max k is 1, else 1.0]"),
    max_tokens: Optional[int] = typer.Option(None, help="Max sampled tokens per turn [default: 256]."),
    max_total_tokens: Optional[int] = typer.Option(None, help="Max tokens per episode, prompt included "
                                                              "[default: 2048]."),
    concurrency: Optional[int] = typer.Option(None, help="Episodes in flight [default: 32]."),
    seed: Optional[int] = typer.Option(None, help="Seeds env resets and sampling; same seed, same episodes "
                                                  "[default: 0]."),
) -> None:
    """Evaluate a model on a suite: success with 95% CIs, pass@k, maj@k, errors; a Markdown and an HTML
    report and a trajectory viewer in the run directory. Interrupted, the same command resumes."""
    from agentrl.cli.jobs import EvalJob
    from agentrl.config import ConfigError, load_config
    from agentrl.env.suites import get_suite
    from agentrl.eval.report import write_report
    from agentrl.eval.run import EvalRunMismatch, run_suite
    from agentrl.eval.viewer import write_viewer
    from agentrl.models.tokenizer import load_tokenizer
    from agentrl.policy.backends import open_policy
    from agentrl.renderer import Renderer

    try:
        ks = sorted({int(x) for x in k.split(",")}) if k is not None else None
    except ValueError:
        console.print(f"[red]--k takes positive integers separated by commas, e.g. 1,8; got {k!r}[/]")
        raise typer.Exit(2)
    remote = model is not None and model.startswith(("http://", "https://"))
    if temperature is None and ks and ks[-1] > 1:
        temperature = 1.0  # pass@k samples; the job's own default is greedy
    overrides = _given(suite=suite, model=model, k=ks, n=n, out=str(out) if out else None, tokenizer=tokenizer,
                       chat_template=chat_template,
                       engine=_given(kind="vllm" if remote else engine, url=model if remote else None,
                                     max_model_len=max_total_tokens),
                       rollout=_given(concurrency=concurrency, max_total_tokens=max_total_tokens, seed=seed,
                                      sampling=_given(max_tokens=max_tokens, temperature=temperature)))
    try:
        job = load_config(EvalJob, config, overrides)
        the_suite = get_suite(job.suite)
    except ConfigError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(2)
    except KeyError as e:
        console.print(f"[red]{e.args[0]}[/]")
        raise typer.Exit(2)
    policy = open_policy(job.model, job.engine)
    tok = load_tokenizer(job.tokenizer or getattr(policy, "model_name", job.model), job.chat_template)
    run_dir = Path(job.out) if job.out else Path("runs/eval") / the_suite.name.replace("/", "-")
    total = sum(min(e.n_tasks, job.n or e.n_tasks) for e in the_suite.entries) * max(job.k)
    with Progress(TextColumn(f"eval {the_suite.name}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as bar:
        progress = bar.add_task("episodes", total=total)
        try:
            run_suite(the_suite, policy, Renderer(tok), run_dir, job.model, job.k, job.n, job.rollout,
                      on_episode=lambda t: bar.advance(progress))
        except EvalRunMismatch as e:
            console.print(f"[red]{e}[/]")
            raise typer.Exit(2)
        finally:
            asyncio.run(policy.close())
    markdown, html = write_report(run_dir)
    viewer = write_viewer(run_dir, tokenizer=tok)
    _print_results(json.loads((run_dir / "results.json").read_text()))
    console.print(f"report: {markdown} · {html}\ntrajectories: {viewer}")


def _print_results(results: dict) -> None:
    """Success with its 95% CI and pass@k per entry, and errors: the rest is in the report."""
    table = Table("entry", "success [95% CI]", *(f"pass@{k}" for k in results["ks"]), "errors")
    for name, m in [*results["entries"].items(), ("all", results["all"])]:
        s = m["success"]
        success = f"{s['rate']:.3f} [{s['low']:.3f}, {s['high']:.3f}]" if s["rate"] is not None else "-"
        passes = [f"{m['pass_at_k'][str(k)]['value']:.3f}" if m["pass_at_k"].get(str(k), {}).get("value")
                  is not None else "-" for k in results["ks"]]
        table.add_row(name, success, *passes, str(m["errors"]["count"]))
    console.print(table)


@app.command()
def report(run_dir: Path = typer.Argument(..., help="An eval run directory (from `agentrl eval`)."),
           vs: Optional[Path] = typer.Option(None, help="Another eval run to compare with, side by side."),
           train_dir: Optional[Path] = typer.Option(None, help="A training run: adds its reward curve."),
           tokenizer: Optional[str] = typer.Option(None, help="Shows trajectories as tokens, coloured by mask.")
           ) -> None:
    """(Re)write RUN_DIR/report.md, report.html and viewer.html."""
    from agentrl.eval.report import write_report
    from agentrl.models.tokenizer import load_tokenizer
    from agentrl.eval.viewer import write_viewer

    if not (run_dir / "run.json").exists():
        console.print(f"[red]{run_dir} is not an eval run directory (no run.json); make one with `agentrl eval`.[/]")
        raise typer.Exit(2)
    markdown, html = write_report(run_dir, vs=vs, train_dir=train_dir)
    viewer = write_viewer(run_dir, tokenizer=load_tokenizer(tokenizer) if tokenizer else None)
    console.print(f"{markdown}\n{html}\n{viewer}")


@app.command()
def compare(run_dirs: list[Path] = typer.Argument(..., help="Training runs (`agentrl train` output directories).")
            ) -> None:
    """Held-out success before and after RL of several training runs, with 95% intervals, and the paired change
    on the same tasks: tasks gained and lost, and McNemar's exact p; the entropy law's predicted ceiling, for runs
    evaluated during training (`[eval] every`)."""
    from agentrl.eval.entropy_law import entropy_law_panel
    from agentrl.eval.metrics import diff_interval, mcnemar_p, paired_change, wilson_interval
    from agentrl.rollout.jsonl import read_records

    def counts(m: dict) -> tuple[int, int]:  # successes and non-error episodes, pooled over the held-out splits
        if "successes" not in m:
            console.print("[red]this summary.json predates stored held-out counts (successes, valid): its rates "
                          "alone cannot be tested; run its `agentrl train` again into a new out_dir[/]")
            raise typer.Exit(2)
        return m["successes"], m["valid"]

    def rate(m: dict) -> str:
        (s, n), (lo, hi) = counts(m), wilson_interval(*counts(m))
        return f"{s / n:.3f} [{lo:.2f}, {hi:.2f}]"

    table = Table("run", "method", "before [95% CI]", "after [95% CI]", "change [95% CI]",
                  "paired: gained / lost (p)", "RL minutes", "handoff after RL", "entropy-law ceiling [95% CI]")
    for run_dir in run_dirs:
        path = run_dir / "summary.json"
        if not path.exists():
            console.print(f"[red]{run_dir} has no summary.json: is it an `agentrl train` output directory?[/]")
            raise typer.Exit(2)
        summary = json.loads(path.read_text())
        before, after = summary.get("before"), summary.get("after")
        change = paired = "-"
        if before and after:
            (sa, na), (sb, nb) = counts(after), counts(before)
            lo, hi = diff_interval(sa, na, sb, nb)
            change = f"{sa / na - sb / nb:+.3f} [{lo:+.2f}, {hi:+.2f}]"
            outcomes = [_heldout_outcomes(run_dir / "heldout" / label) for label in ("before_RL", "after_RL")]
            if all(outcomes):
                _, gained, lost = paired_change(*outcomes)
                paired = f"+{gained} / -{lost} (p={mcnemar_p(gained, lost):.2g})"
        handoff = ", ".join(f"{k} {v:.3f}" for k, v in (after or {}).get("handoff", {}).items())
        metrics = run_dir / "metrics.jsonl"
        law = entropy_law_panel(read_records(metrics), summary) if metrics.exists() else None
        table.add_row(str(run_dir), summary.get("method", "-"), rate(before) if before else "-",
                      rate(after) if after else "-", change, paired,
                      f"{summary['rl_seconds'] / 60:.1f}" if "rl_seconds" in summary else "-", handoff,
                      f"{law['law'].ceiling:.3f} [{law['law'].low:.2f}, {law['law'].high:.2f}]" if law else "-")
    console.print(table)


def _heldout_outcomes(label_dir: Path) -> dict[tuple[str, str], bool]:
    """(split, task id) -> success of a training run's held-out evaluation as `agentrl train` saved it, errors left
    out as in the rates; empty when it is missing."""
    from agentrl.rollout.jsonl import read_jsonl
    from agentrl.types import Status

    path = label_dir / "trajectories.jsonl"
    return {(t.info["split"], t.task_id): t.info["success"] for t in (read_jsonl(path) if path.exists() else [])
            if t.status is not Status.ERROR}


@app.command()
def attempts(
    env: str = typer.Option(..., help="Env id, e.g. math/arith-v0."),
    model: list[str] = typer.Option(..., help="Model directory; give it several times to compare models (e.g. "
                                              "before and after RL)."),
    kwargs: str = typer.Option("{}", help="The env's kwargs as a JSON object."),
    chat_template: Optional[str] = typer.Option(None, help=CHAT_TEMPLATE_HELP),
    split: str = typer.Option("heldout", help="The env split whose tasks are attempted."),
    n: int = typer.Option(100, help="Tasks."),
    k: int = typer.Option(4, help="Attempts per task."),
    max_notes: int = typer.Option(3, help="Notes kept per task (memory)."),
    temperature: float = typer.Option(1.0, help="Sampling temperature (0: greedy; plain attempts then repeat)."),
    max_tokens: int = typer.Option(256, help="Max sampled tokens per turn."),
    max_total_tokens: int = typer.Option(2048, help="Max tokens per episode, prompt included."),
    seed: int = typer.Option(0, help="Seeds the attempts' sampling; the same per attempt in every run."),
    out: Path = typer.Option(Path("runs/attempts"), help="Where attempts.json, .md and .png go, and each run's "
                                                        "trajectories (RUN/trajectories.jsonl)."),
) -> None:
    """Success at attempt k, with and without memory across attempts (Reflexion-style notes, agentrl/env/memory.py),
    for each model: pass@k's sequential cousin."""
    from agentrl.eval.attempts import CONDITIONS, run_attempts, write_attempts
    from agentrl.models.tokenizer import load_tokenizer
    from agentrl.policy.backends import EngineConfig, open_policy
    from agentrl.policy.protocol import SamplingParams
    from agentrl.renderer import Renderer
    from agentrl.rollout.engine import RolloutConfig

    for path in model:
        if _missing_directory(path):
            console.print(f"[red]No model directory at {path!r}.[/]")
            raise typer.Exit(2)
    env_kwargs = json.loads(kwargs)
    tasks = list(_make_or_exit(env, split=split, **env_kwargs).tasks)[:n]
    rollout = RolloutConfig(seed=seed, max_total_tokens=max_total_tokens,
                            sampling=SamplingParams(temperature=temperature, max_tokens=max_tokens))
    runs = {}
    for path in model:
        policy, renderer = open_policy(path, EngineConfig()), Renderer(load_tokenizer(path, chat_template))
        try:
            for condition in CONDITIONS:
                label = f"{Path(path).name} {condition}"
                with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                              console=console) as bar:
                    progress = bar.add_task("attempts", total=len(tasks) * k)
                    runs[label] = run_attempts(env, env_kwargs, split, tasks, k, policy, renderer, rollout,
                                               condition == "memory", max_notes, lambda: bar.advance(progress),
                                               out / label.replace(" ", "_") / "trajectories.jsonl")
                console.print(f"{label}: success@1..{k} " + " ".join(f"{r:.3f}" for r in runs[label]["success_at"])
                              + "".join(f"\n  [red]{n} errors: {reason}[/]" for reason, n in
                                        runs[label]["error_reasons"].items()))
        finally:
            asyncio.run(policy.close())
    markdown, _ = write_attempts(out, runs, {"env": env, "env_kwargs": env_kwargs, "split": split, "tasks": len(tasks),
                                             "k": k, "temperature": temperature, "seed": seed, "models": model,
                                             "chat_template": chat_template})
    console.print(f"report: {markdown}")


@app.command("suites")
def suites_list() -> None:
    """Registered evaluation suites and their entries."""
    from agentrl.env.suites import suites

    table = Table("suite", "version", "entries (env:split × tasks)", "description")
    for s in suites().values():
        table.add_row(s.name, str(s.version), "\n".join(f"{e.name} × {e.n_tasks}" for e in s.entries),
                      s.description)
    console.print(table)


def _given(**options):
    """The options the user gave (not None, not empty), as a nested override dict."""
    return {k: v for k, v in options.items() if v is not None and v != {}}


def _make_or_exit(env_id: str, **kwargs):
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


if __name__ == "__main__":
    app()
