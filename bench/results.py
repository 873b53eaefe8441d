"""Benchmark figures on disk, and their page.

Each `bench/NAME.py` ends with `record(__file__, figures)`: it prints the figures as the last line (one JSON object,
as every bench does) and keeps them in `bench/results/NAME.json` with the command, the date, the commit and the
machine (processor, its vector extensions, cores). `python bench/results.py` (`make results`) renders every recorded
run into `docs/results/benchmarks.md`, so the page's figures come from running the benches, never from editing it.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "results" / "benchmarks.md"


def machine() -> dict:
    """The processor's model name, its vector extensions (what CPU timings depend on) and the cores."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                 platform.processor())
    flags = next((line for line in info.splitlines() if line.startswith("flags")), "").split()
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "neither AVX-512 nor AVX2"
    return {"processor": model, "vector": vector, "cores": os.cpu_count()}


def commit() -> str:
    """The checkout's commit, with `+changes` when the tree differs from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def record(script: str, figures: dict) -> None:
    """Print `figures` as the bench's last line and keep them, with how and where they were measured."""
    name = Path(script).stem
    RESULTS.mkdir(exist_ok=True)
    run = {"bench": name, "command": " ".join(["python", f"bench/{name}.py", *sys.argv[1:]]),
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit(),
           "machine": machine(), "figures": figures}
    (RESULTS / f"{name}.json").write_text(json.dumps(run, indent=1) + "\n")
    print(json.dumps(figures))


def render(results: Path = RESULTS) -> str:
    """The benchmarks page: per bench, its last recorded run's command, date, commit, machine and figures."""
    benches = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem != "results")
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(results.glob("*.json"))}
    lines = ["# Benchmarks", "",
             "Each `bench/` script measures a ratio against a baseline run in the same process (the machines are noisy)",
             "and records its last run in `bench/results/NAME.json`. This page is rendered from those files by",
             "`make results`; rerun a bench to refresh its row. The script's docstring says what is compared.", "",
             "| bench | figures | command | machine | date, commit |", "|---|---|---|---|---|"]
    for name in benches:
        run = runs.get(name)
        if run is None:
            lines.append(f"| `{name}` | not recorded yet | `python bench/{name}.py` | | |")
            continue
        m = run["machine"]
        figures = ", ".join(f"{k} {json.dumps(v)}" for k, v in run["figures"].items() if not isinstance(v, (dict, list)))
        lines.append(f"| `{name}` | {figures} | `{run['command']}` | {m['cores']} cores, {m['vector']} "
                     f"({m['processor']}) | {run['date']}, {run['commit']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    PAGE.write_text(render())
    print(f"wrote {PAGE.relative_to(ROOT)}")
