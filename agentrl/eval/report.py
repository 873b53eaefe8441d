"""Reports a person can read: RUN_DIR/report.md and a self-contained RUN_DIR/report.html.

The numbers come from `eval_metrics.summarize_run` over RUN_DIR/trajectories.jsonl, recomputed here so an
interrupted run reports what it finished. The HTML needs nothing from the network: inline CSS, plots as
inline base64 PNGs (matplotlib, Agg). Both files are rendered from jinja2 templates in `templates/`; the
HTML one autoescapes, because answers and error messages are untrusted model and tool output.
"""

from __future__ import annotations

import base64
import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import jinja2

from agentrl.eval.entropy_law import entropy_law_panel
from agentrl.eval.metrics import diff_interval, summarize_run
from agentrl.rollout.jsonl import read_jsonl, read_records
from agentrl.types import Trajectory

TEMPLATES = Path(__file__).parent / "templates"
PLOTS_DIR = "report_files"  # beside report.md: the Markdown's images (the HTML embeds its own)
LANES = ("engine", "env", "trainer")  # the resources trainers/loop.py's Timeline records, top lane first
TIMELINE_STEPS = 20  # the timeline plot draws a longer run's last steps only: more steps are bars too thin to read
# A row whose intervals start this long before the previous row's end comes from a resumed run (a clock back at 0);
# within one run they start at most a rounding or a few microseconds (the lanes are cut one after another) before it.
RESTART_SLACK_S = 0.01


# ------------------------------------------------------------------------------------------------ inputs

def load_run(run_dir: str | Path) -> tuple[dict[str, Any], list[Trajectory]]:
    """run.json and the trajectories of an eval run directory (from `agentrl eval`)."""
    run_dir = Path(run_dir)
    if not (run_dir / "run.json").exists():
        raise FileNotFoundError(f"{run_dir} has no run.json: not an eval run directory (make one with `agentrl eval`)")
    run = json.loads((run_dir / "run.json").read_text())
    log = run_dir / "trajectories.jsonl"
    return run, read_jsonl(log) if log.exists() else []


def run_results(run_dir: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(run.json, summarize_run of its trajectories), entries in the order run.json lists them."""
    run, trajectories = load_run(run_dir)
    results = summarize_run(trajectories, run["k"])
    order = [e["name"] for e in run.get("entries", [])]
    names = [n for n in order if n in results["entries"]] + [n for n in results["entries"] if n not in order]
    results["entries"] = {n: results["entries"][n] for n in names}
    return run, results


def load_training(train_dir: str | Path) -> dict[str, Any]:
    """A training run's per-step metrics.jsonl rows and its summary.json (held-out before/after), if any."""
    train_dir = Path(train_dir)
    metrics = train_dir / "metrics.jsonl"
    if not metrics.exists():
        raise FileNotFoundError(f"{train_dir} has no metrics.jsonl: not a training run directory (`agentrl train`)")
    rows = read_records(metrics)
    summary_path = train_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return {"dir": str(train_dir), "rows": rows, "summary": summary}


# ----------------------------------------------------------------------------------------------- report

def write_report(run_dir: str | Path, vs: str | Path | None = None,
                 train_dir: str | Path | None = None) -> tuple[Path, Path]:
    """Writes RUN_DIR/report.md and RUN_DIR/report.html (plus the Markdown's PNGs in RUN_DIR/report_files).

    `vs`: another eval run, compared entry by entry. `train_dir` (default: run.json's "train_dir"): a
    training run whose reward curve is added, and its timeline with the idle fractions when its rows have one."""
    run_dir = Path(run_dir)
    run, results = run_results(run_dir)
    other = None
    if vs is not None:
        other_run, other_results = run_results(vs)
        other = {"dir": str(vs), "run": other_run, "results": other_results}
    train_dir = train_dir if train_dir is not None else run.get("train_dir")
    training = load_training(train_dir) if train_dir is not None else None

    comparison = compare(results, other["results"]) if other else None
    plots = {"success": plot_success(results, other["results"] if other else None,
                                     _label(run_dir, run), _label(Path(vs), other["run"]) if other else None)}
    for key in _difficulty_keys(results):
        plots[f"difficulty_{key}"] = plot_difficulty(results, key)
    train_rows = training["rows"] if training else []
    if train_rows:
        plots["reward_curve"] = plot_reward_curve(train_rows)
    if any("mean_tool_calls" in row for row in train_rows):  # runs from before these metrics have none
        plots["learning_dynamics"] = plot_learning_dynamics(train_rows)
    has_timeline = any("timeline" in row for row in train_rows)  # runs from before the timeline have none
    if has_timeline:
        plots["timeline"] = plot_timeline(train_rows)
    entropy_law = entropy_law_panel(train_rows, training["summary"]) if training else None
    if entropy_law:
        plots["entropy_law"] = plot_entropy_law(entropy_law)

    (run_dir / PLOTS_DIR).mkdir(exist_ok=True)
    for name, png in plots.items():
        (run_dir / PLOTS_DIR / f"{name}.png").write_bytes(png)
    context = {
        "run": run, "results": results, "label": _label(run_dir, run),
        "ks": sorted({int(k) for m in _rows(results) for k in m["pass_at_k"]}),
        "has_maj": any(m["maj_at_k"] for m in _rows(results)),
        "difficulty": _difficulty_tables(results),
        "other": other, "other_label": _label(Path(vs), other["run"]) if other else None,
        "comparison": comparison, "training": training, "entropy_law": entropy_law,
        "idle_summary": idle_table(train_rows) if has_timeline else None,
        "viewer": {name: "viewer.html#entry=" + quote(name, safe="") for name in results["entries"]},
        "plots_dir": PLOTS_DIR, "plot_names": list(plots),
        "plots": {name: base64.b64encode(png).decode() for name, png in plots.items()},
    }
    md, html = run_dir / "report.md", run_dir / "report.html"
    md.write_text(render("report.md.jinja", **context))
    html.write_text(render("report.html.jinja", **context))
    return md, html


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Per entry (those of run a, then those only b has) and overall: both success rates and a − b with
    its 95% interval; `verdict` says whether that interval excludes 0."""
    names = list(a["entries"]) + [n for n in b["entries"] if n not in a["entries"]]
    rows = []
    for name, ma, mb in [(n, a["entries"].get(n), b["entries"].get(n)) for n in names] + [("all", a["all"], b["all"])]:
        row: dict[str, Any] = {"name": name, "a": ma, "b": mb, "diff": None, "low": None, "high": None,
                               "reward_diff": None, "verdict": ""}
        if ma and mb and ma["success"]["n"] and mb["success"]["n"]:
            sa, sb = ma["success"], mb["success"]
            row["diff"] = sa["rate"] - sb["rate"]
            row["low"], row["high"] = diff_interval(sa["successes"], sa["n"], sb["successes"], sb["n"])
            row["verdict"] = "better" if row["low"] > 0 else "worse" if row["high"] < 0 else "within noise"
            if ma["reward"]["mean"] is not None and mb["reward"]["mean"] is not None:
                row["reward_diff"] = ma["reward"]["mean"] - mb["reward"]["mean"]
        rows.append(row)
    return rows


def render(template: str, **context: Any) -> str:
    """Renders one of `templates/`; *.html.jinja autoescaped (what we show is untrusted model output)."""
    return _environment().get_template(template).render(**context)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                             autoescape=lambda name: bool(name) and name.endswith(".html.jinja"),
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters.update(num=_num, ci=_ci, md=_md)
    return env


def _num(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.{digits}f}"


def _ci(d: dict[str, Any] | None, digits: int = 2) -> str:
    """"[low, high]" of a summary dict (or of a comparison row), "" when undefined."""
    if not d or d.get("low") is None:
        return ""
    return f"[{d['low']:.{digits}f}, {d['high']:.{digits}f}]"


def _md(text: Any) -> str:
    """Text made safe inside a Markdown table cell: no cell breaks, no raw HTML."""
    out = str(text).replace("\\", "\\\\").replace("|", "\\|").replace("`", "\\`")
    return out.replace("<", "&lt;").replace(">", "&gt;").replace("\r", " ").replace("\n", " ")


def _label(run_dir: Path, run: dict[str, Any]) -> str:
    return f"{run_dir.name} ({run.get('model', '?')})"


def _rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    return [*results["entries"].values(), results["all"]]


def _difficulty_keys(results: dict[str, Any]) -> list[str]:
    return list(results["all"]["by_difficulty"])


def _difficulty_tables(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per difficulty key: its values (in the pooled order) and one row per entry that has the key."""
    tables = {}
    for key in _difficulty_keys(results):
        values = list(results["all"]["by_difficulty"][key])
        rows = [(name, m["by_difficulty"][key]) for name, m in results["entries"].items() if key in m["by_difficulty"]]
        tables[key] = {"values": values, "rows": [*rows, ("all", results["all"]["by_difficulty"][key])]}
    return tables


# ------------------------------------------------------------------------------------------------- plots

def pyplot():
    """matplotlib's pyplot, drawing without a display (the Agg backend, chosen before pyplot is imported)."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede the pyplot import
    import matplotlib.pyplot as plt

    return plt


def png_bytes(fig) -> bytes:
    """`fig` as PNG bytes; the figure is closed (pyplot keeps every open one)."""
    plt = pyplot()
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _errors(props: Sequence[dict[str, Any]]) -> list[list[float]]:
    """Asymmetric error bars [[below...], [above...]] from proportion dicts (0 where undefined)."""
    rate = [p["rate"] or 0.0 for p in props]  # max(0, ...): at 0/n the Wilson bound is 0 only up to rounding
    return [[max(0.0, r - (p["low"] if p["low"] is not None else r)) for r, p in zip(rate, props, strict=True)],
            [max(0.0, (p["high"] if p["high"] is not None else r) - r) for r, p in zip(rate, props, strict=True)]]


def plot_success(results: dict[str, Any], other: dict[str, Any] | None = None, label: str | None = None,
                 other_label: str | None = None) -> bytes:
    """Horizontal bars: success per entry and overall, with 95% Wilson intervals; two runs side by side."""
    plt = pyplot()
    names = list(results["entries"]) + ["all"]
    runs = [(label or "this run", results)] + ([(other_label or "other run", other)] if other else [])
    fig, ax = plt.subplots(figsize=(7.5, 1.2 + 0.42 * len(names) * len(runs)))
    height = 0.8 / len(runs)
    for i, (run_label, res) in enumerate(runs):
        props = [(res["all"] if n == "all" else res["entries"].get(n, {})).get("success") or
                 {"rate": None, "low": None, "high": None} for n in names]
        ys = [j + (i - (len(runs) - 1) / 2) * height for j in range(len(names))]
        ax.barh(ys, [p["rate"] or 0.0 for p in props], height=height * 0.9, xerr=_errors(props), capsize=3,
                label=run_label, color=f"C{i}")
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("success rate (95% CI)")
    ax.grid(axis="x", alpha=0.3)
    if other:
        ax.legend(loc="lower right", fontsize="small")
    return png_bytes(fig)


def plot_difficulty(results: dict[str, Any], key: str) -> bytes:
    """Grouped bars: success per value of one difficulty key (e.g. hops), one bar per entry that has it."""
    plt = pyplot()
    values = list(results["all"]["by_difficulty"][key])
    series = [(n, m["by_difficulty"][key]) for n, m in results["entries"].items() if key in m["by_difficulty"]]
    if len(series) > 1:
        series.append(("all", results["all"]["by_difficulty"][key]))
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    width = 0.8 / len(series)
    empty = {"rate": None, "low": None, "high": None}
    for i, (name, by_value) in enumerate(series):
        props = [by_value.get(v, empty) for v in values]
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(values))]
        ax.bar(xs, [p["rate"] or 0.0 for p in props], width=width * 0.9, yerr=_errors(props), capsize=3,
               label=name, color=f"C{i}")
    ax.set_xticks(range(len(values)), values)
    ax.set_xlabel(key)
    ax.set_ylim(0, 1)
    ax.set_ylabel("success rate (95% CI)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return png_bytes(fig)


def plot_reward_curve(rows: Sequence[dict[str, Any]]) -> bytes:
    """Mean reward and success per RL step (the training run's metrics.jsonl)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    steps = [r["step"] for r in rows]
    for key in ("mean_reward", "success"):
        if any(key in r for r in rows):
            ax.plot(steps, [r.get(key, float("nan")) for r in rows], marker="." if len(rows) < 50 else None,
                    label=key.replace("_", " "))
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return png_bytes(fig)


DYNAMICS = (("success", "success"), ("mean_tool_calls", "tool calls (searches) per episode"),
            ("mean_sampled_tokens", "sampled tokens per episode"), ("valid_action_rate", "valid-action rate"))


def plot_learning_dynamics(rows: Sequence[dict[str, Any]]) -> bytes:
    """Search-R1's training figures, per RL step: success, tool calls and response length per episode, and the
    share of turns whose action the env took."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(DYNAMICS), figsize=(12, 2.8))
    steps = [r["step"] for r in rows]
    for ax, (key, title) in zip(axes, DYNAMICS):
        ax.plot(steps, [r.get(key, float("nan")) for r in rows], marker="." if len(rows) < 50 else None)
        ax.set_title(title, fontsize="small")
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return png_bytes(fig)


def plot_entropy_law(panel: dict[str, Any]) -> bytes:
    """Held-out success against the policy's entropy, the fitted law down to H = 0, and its ceiling with the 95%
    interval (`entropy_law_panel`)."""
    import numpy as np

    plt, law = pyplot(), panel["law"]
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    steps, entropy, success = zip(*panel["points"])
    dots = ax.scatter(entropy, success, c=steps, cmap="viridis", zorder=3)
    fig.colorbar(dots, ax=ax, label="RL step")
    grid = np.linspace(0, max(entropy) * 1.05, 100)
    ax.plot(grid, [law.predict(h) for h in grid], color="grey",
            label=f"R = -{law.a:.3g}·exp(H) + {law.b:.3g}  (R² {law.r2:.2f})")
    ax.errorbar([0], [law.ceiling], yerr=[[law.ceiling - law.low], [law.high - law.ceiling]], fmt="s", color="C3",
                capsize=4, label=f"ceiling {law.ceiling:.3f} [{law.low:.2f}, {law.high:.2f}]")
    ax.set_xlabel("policy entropy H (nats per sampled token)")
    ax.set_ylabel("held-out success")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return png_bytes(fig)


# ---------------------------------------------------------------------------------------------- timeline

def timeline_steps(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The metrics rows that have a `timeline`, their busy intervals on one clock for the whole run.

    Each: `step`, `spans` ({resource: [[t0, t1], ...]}), `end` (its last interval's end: the step boundary) and
    `resumed`. A resumed run's clock restarts at 0: its rows are moved to start at the previous row's end, and
    its first row is marked `resumed`."""
    steps: list[dict[str, Any]] = []
    offset, last_end = 0.0, None
    for row in rows:
        if "timeline" not in row:
            continue
        names = [*LANES, *(name for name in row["timeline"] if name not in LANES)]
        spans = {name: row["timeline"].get(name, []) for name in names}
        times = [t for intervals in spans.values() for interval in intervals for t in interval]
        resumed = bool(times) and last_end is not None and min(times) + offset < last_end - RESTART_SLACK_S
        if resumed:
            offset = last_end
        spans = {name: [[a + offset, b + offset] for a, b in intervals] for name, intervals in spans.items()}
        # a step with no interval at all (nothing ran) ends where the previous one did
        last_end = max(times) + offset if times else (last_end or 0.0)
        steps.append({"step": row.get("step"), "spans": spans, "end": last_end, "resumed": resumed})
    return steps


def idle_table(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The mean over steps of each resource's idle fraction (the metrics rows' `idle`), and for asynchronous runs
    the groups trained per staleness summed over the steps and the total of stale groups dropped.

    Returns {"steps": steps with an `idle`, "idle": {resource: mean}, "staleness": {"0": n, ...} or None,
    "stale_groups": int or None}; the asynchronous figures are None when no row has them."""
    idle_rows = [row["idle"] for row in rows if "idle" in row]
    names = list(dict.fromkeys([*(n for n in LANES if any(n in idle for idle in idle_rows)),
                                *(n for idle in idle_rows for n in idle)]))
    idle = {}
    for name in names:
        values = [row[name] for row in idle_rows if name in row]
        idle[name] = sum(values) / len(values)
    staleness: dict[str, int] | None = None
    if any("staleness" in row for row in rows):
        summed: dict[int, int] = {}
        for row in rows:
            for lag, groups in row.get("staleness", {}).items():
                summed[int(lag)] = summed.get(int(lag), 0) + groups
        staleness = {str(lag): summed[lag] for lag in sorted(summed)}
    stale_groups = (sum(row.get("stale_groups", 0) for row in rows)
                    if any("stale_groups" in row for row in rows) else None)
    return {"steps": len(idle_rows), "idle": idle, "staleness": staleness, "stale_groups": stale_groups}


def plot_timeline(rows: Sequence[dict[str, Any]]) -> bytes:
    """Gantt chart of the training run's busy intervals: one lane per resource (engine, env, trainer), thin
    vertical lines at the step boundaries, the mean idle fractions in the title. A run of more than
    `TIMELINE_STEPS` steps shows its last ones. Raises ValueError when no row has a timeline."""
    steps = timeline_steps(rows)
    if not steps:
        raise ValueError("no metrics row has a timeline (a run from before trainers/loop.py recorded one)")
    plt = pyplot()
    shown = steps[-TIMELINE_STEPS:]
    earlier = steps[:-TIMELINE_STEPS]
    left = earlier[-1]["end"] if earlier else 0.0  # where the first step drawn began
    lanes = list(dict.fromkeys(name for step in shown for name in step["spans"]))
    fig, ax = plt.subplots(figsize=(7.5, 1.3 + 0.45 * len(lanes)))
    for i, name in enumerate(lanes):
        bars = [(a, b - a) for step in shown for a, b in step["spans"].get(name, [])]
        # an edge as wide as a pixel keeps intervals far shorter than a pixel visible
        ax.broken_barh(bars, (len(lanes) - 1 - i - 0.35, 0.7), facecolors=f"C{i}", edgecolors=f"C{i}", linewidth=0.3)
    step_start = left
    for step in shown:
        if step["resumed"]:
            ax.axvline(step_start, color="C3", linestyle="--", linewidth=0.8)
        ax.axvline(step["end"], color="0.5", linewidth=0.5)
        if step["step"] is not None:
            ax.text((step_start + step["end"]) / 2, len(lanes) - 0.5, str(step["step"]), ha="center", va="bottom",
                    fontsize=6, color="0.35")
        step_start = step["end"]
    ax.axvline(left, color="0.5", linewidth=0.5)
    ax.set_yticks(range(len(lanes)), reversed(lanes))
    ax.set_ylim(-0.6, len(lanes) - 0.5 + 0.45)
    ax.set_xlim(left, max(shown[-1]["end"], left + 1e-3))
    resumes = any(step["resumed"] for step in shown)
    ax.set_xlabel("seconds since the run started" + (" (dashed: a resumed run, placed after the last step before)"
                                                     if resumes else ""))
    idle = idle_table([row for row in rows if "timeline" in row][-TIMELINE_STEPS:])["idle"]
    which = f"last {len(shown)} of {len(steps)} steps" if earlier else f"{len(shown)} steps"
    ax.set_title(f"busy per step ({which}); mean idle: "
                 + ", ".join(f"{name} {fraction:.0%}" for name, fraction in idle.items()), fontsize="medium")
    ax.grid(axis="x", alpha=0.3)
    return png_bytes(fig)
