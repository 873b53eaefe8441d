"""`agentrl eval`, `report`, `compare`, `baselines`, `attempts` and `suites`: measuring models and training runs."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from agentrl.cli.common import CHAT_TEMPLATE_HELP, console, given, make_or_exit, missing_directory, progress_bar


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
    report and a trajectory viewer in the run directory. Interrupted, the same command resumes.

    Example: agentrl eval --suite recipes/search_r1_rag_suite.toml --model DIR --engine vllm
    """
    from agentrl.cli.jobs import EvalJob
    from agentrl.config import ConfigError, load_config
    from agentrl.env.api import EnvNotReady
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
    overrides = given(suite=suite, model=model, k=ks, n=n, out=str(out) if out else None, tokenizer=tokenizer,
                       chat_template=chat_template, temperature=temperature,
                       engine=given(kind="vllm" if remote else engine, url=model if remote else None,
                                     max_model_len=max_total_tokens),
                       rollout=given(concurrency=concurrency, max_total_tokens=max_total_tokens, seed=seed,
                                      sampling=given(max_tokens=max_tokens)))
    try:
        job = load_config(EvalJob, config, overrides)
        the_suite = get_suite(job.suite)
    except ConfigError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(2)
    except KeyError as e:
        console.print(f"[red]{e.args[0]}[/]")
        raise typer.Exit(2)
    try:  # what the suite's envs need outside this process, before the engine starts
        for entry in the_suite.entries:
            make_or_exit(entry.env, split=entry.split, **entry.env_kwargs).check_ready()
    except EnvNotReady as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(1)
    policy = open_policy(job.model, job.engine)
    tok = load_tokenizer(job.tokenizer or getattr(policy, "model_name", job.model), job.chat_template)
    run_dir = Path(job.out) if job.out else Path("runs/eval") / the_suite.name.replace("/", "-")
    total = sum(min(e.n_tasks, job.n or e.n_tasks) for e in the_suite.entries) * max(job.k)
    with progress_bar(f"eval {the_suite.name}") as bar:
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


def report(run_dir: Path = typer.Argument(..., help="An eval run directory (from `agentrl eval`)."),
           vs: Optional[Path] = typer.Option(None, help="Another eval run to compare with, side by side."),
           train_dir: Optional[Path] = typer.Option(None, help="A training run: adds its reward curve."),
           tokenizer: Optional[str] = typer.Option(None, help="Shows trajectories as tokens, coloured by mask.")
           ) -> None:
    """(Re)write RUN_DIR/report.md, report.html and viewer.html.

    Example: agentrl report runs/demo/eval
    """
    from agentrl.eval.report import write_report
    from agentrl.eval.viewer import write_viewer
    from agentrl.models.tokenizer import load_tokenizer

    if not (run_dir / "run.json").exists():
        console.print(f"[red]{run_dir} is not an eval run directory (no run.json); make one with `agentrl eval`.[/]")
        raise typer.Exit(2)
    markdown, html = write_report(run_dir, vs=vs, train_dir=train_dir)
    viewer = write_viewer(run_dir, tokenizer=load_tokenizer(tokenizer) if tokenizer else None)
    console.print(f"{markdown}\n{html}\n{viewer}")


def compare(run_dirs: list[Path] = typer.Argument(..., help="Training runs (`agentrl train` output directories).")
            ) -> None:
    """Held-out success before and after RL of several training runs, with 95% intervals, and the paired change
    on the same tasks: tasks gained and lost, and McNemar's exact p; the entropy law's predicted ceiling, for runs
    evaluated during training (`[eval] every`).

    Example: agentrl compare runs/math-grpo runs/math-tandem
    """
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
            outcomes = [_outcomes(run_dir / "heldout" / label) for label in ("before_RL", "after_RL")]
            if all(outcomes):
                _, gained, lost = paired_change(*outcomes)
                paired = f"+{gained} / -{lost} (p={mcnemar_p(gained, lost):.2g})"
        handoff = ", ".join(f"{k} {v:.3f}" for k, v in (after or {}).get("handoff", {}).items())
        metrics = run_dir / "metrics.jsonl"
        law = entropy_law_panel(read_records(metrics), summary) if metrics.exists() else None
        table.add_row(escape(str(run_dir)), escape(summary.get("method", "-")), rate(before) if before else "-",
                      rate(after) if after else "-", change, paired,
                      f"{summary['rl_seconds'] / 60:.1f}" if "rl_seconds" in summary else "-", handoff,
                      f"{law['law'].ceiling:.3f} [{law['law'].low:.2f}, {law['law'].high:.2f}]" if law else "-")
    console.print(table)


def _outcomes(run_dir: Path) -> dict[tuple[str, str], bool]:
    """(split, task id) -> success of an evaluation's episodes (`agentrl eval`'s run directory, or a training run's
    OUT/heldout/LABEL), errors left out as in the rates; empty when it has no trajectories. One episode per task:
    a run with several (pass@k) is refused, its tasks having no one outcome to pair."""
    from agentrl.rollout.jsonl import read_jsonl
    from agentrl.types import Status

    path = run_dir / "trajectories.jsonl"
    episodes = [t for t in (read_jsonl(path) if path.exists() else []) if t.status is not Status.ERROR]
    outcomes = {(t.logs["split"], t.task_id): t.metrics["success"] for t in episodes}
    if len(outcomes) < len(episodes):
        console.print(f"[red]{run_dir} has several episodes of a task (pass@k): pair runs of one episode per task "
                      f"(`agentrl eval --k 1`)[/]")
        raise typer.Exit(2)
    return outcomes


def baselines(rows: list[str] = typer.Argument(..., help="NAME=DIR for each row: an eval run directory (`agentrl "
                                                         "eval`) or a training run's OUT/heldout/LABEL."),
              against: str = typer.Option(..., help="The row that the others are paired against."),
              out: Optional[Path] = typer.Option(None, help="Also write the table to this Markdown file.")) -> None:
    """Several evaluations of the same tasks in one table (Search-R1's baselines): per suite the success rate with
    its 95% interval, the mean over the suites, and the paired change against one row (gained / lost, McNemar's
    exact p).

    Example: agentrl baselines RAG=runs/rag SFT=runs/run/heldout/before_RL --against SFT
    """
    from agentrl.eval.table import results_table

    named = {}
    for row in rows:
        name, sep, directory = row.partition("=")
        if not sep or not name or not directory:
            console.print(f"[red]rows are NAME=DIR, e.g. 'RAG=runs/eval/rag'; got {row!r}[/]")
            raise typer.Exit(2)
        if not (Path(directory) / "trajectories.jsonl").exists():
            console.print(f"[red]{directory} has no trajectories.jsonl: give an `agentrl eval` run directory or a "
                          f"training run's OUT/heldout/LABEL[/]")
            raise typer.Exit(2)
        named[name] = _outcomes(Path(directory))
    try:
        table = results_table(named, against)
    except KeyError as e:
        console.print(f"[red]{e.args[0]}[/]")
        raise typer.Exit(2)
    console.print(table, markup=False, highlight=False, soft_wrap=True)  # a Markdown table: one line a row
    if out:
        out.write_text(table)
        console.print(f"table: {out}")


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
    for each model: pass@k's sequential cousin.

    Example: agentrl attempts --env memory/reflexion-v0 --model DIR --k 4
    """
    from agentrl.eval.attempts import CONDITIONS, run_attempts, write_attempts
    from agentrl.models.tokenizer import load_tokenizer
    from agentrl.policy.backends import EngineConfig, open_policy
    from agentrl.policy.protocol import SamplingParams
    from agentrl.renderer import Renderer
    from agentrl.rollout.engine import RolloutConfig

    for path in model:
        if missing_directory(path):
            console.print(f"[red]No model directory at {path!r}.[/]")
            raise typer.Exit(2)
    env_kwargs = json.loads(kwargs)
    tasks = list(make_or_exit(env, split=split, **env_kwargs).tasks)[:n]
    rollout = RolloutConfig(seed=seed, max_total_tokens=max_total_tokens,
                            sampling=SamplingParams(temperature=temperature, max_tokens=max_tokens))
    runs = {}
    for path in model:
        policy, renderer = open_policy(path, EngineConfig()), Renderer(load_tokenizer(path, chat_template))
        try:
            for condition in CONDITIONS:
                label = f"{Path(path).name} {condition}"
                with progress_bar(label) as bar:
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


def suites_list(as_json: bool = typer.Option(False, "--json", help="Plain JSON (name, version, entries) for scripts.")
                ) -> None:
    """Registered evaluation suites and their entries.

    Example: agentrl suites --json
    """
    from agentrl.env.suites import suites

    if as_json:
        typer.echo(json.dumps([{"name": s.name, "version": s.version, "description": s.description,
                                "entries": [{"env": e.env, "split": e.split, "tasks": e.n_tasks, "kwargs": e.env_kwargs}
                                            for e in s.entries]} for s in suites().values()], indent=1))
        return
    table = Table("suite", "version", "entries (env:split × tasks)", "description")
    for s in suites().values():
        table.add_row(s.name, str(s.version), "\n".join(f"{e.name} × {e.n_tasks}" for e in s.entries),
                      s.description)
    console.print(table)
