"""Virtualenvs for envs whose dependencies cannot live beside the trainer's (docs/adapters.md, "An env in its own
virtualenv").

    register("bench/foo-v0", "foo_env.env:FooEnv", venv=Venv(python="3.12", requirements=("foo-env==0.4",)))

`ensure(venv)` creates the virtualenv once, under `~/.cache/agentrl/env-venvs/<key>`, keyed by the interpreter's
version, the requirements (a requirements file by its content) and agentrl's own version: a second job, or a
second process of the same job, finds it ready. A file lock serializes the creation across processes; a venv left
half-built by a killed process has no `ready` marker and is built again. Into it go the requirements, the few
packages agentrl's env layer and its env server import (`SERVER_REQUIREMENTS`; not torch, not vLLM), and agentrl
itself without its dependencies, from where this process imports it. The stdlib's `venv` and the interpreter's own
pip do the work, so the machine's pip configuration (indexes, find-links, constraints) applies.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

from filelock import FileLock
from pydantic import with_config

import agentrl
from agentrl.config import STRICT
from agentrl.system.lifetime import ProcessGroup

CACHE = Path.home() / ".cache" / "agentrl" / "env-venvs"

# What `agentrl.env.adapters.openenv_server` imports (agentrl's env layer and tools included), with the lowest
# releases agentrl is tested against. OpenEnv pins fastmcp<4, so it goes in alone, without its dependencies.
SERVER_REQUIREMENTS = ("gymnasium>=1.0", "numpy", "pydantic>=2", "jinja2>=3.1", "rich>=13", "httpx>=0.27",
                       "fastapi>=0.110", "uvicorn>=0.29", "transformers>=4.51", "filelock", "fastmcp>=4", "websockets")
OPENENV = "openenv==0.10.0"


class VenvError(RuntimeError):
    """The env's virtualenv cannot be made (no such Python, pip refused the requirements), or a command in it
    failed."""


@with_config(STRICT)
@dataclass(frozen=True)
class Venv:
    """An env's own virtualenv: `python`, a version ("3.12") or an interpreter's path ("" = this one's version);
    `requirements`, pip requirement strings (a package, a pin, a local path, `-r FILE`, `-e PATH`)."""

    python: str = ""
    requirements: tuple[str, ...] = ()
    serves: bool = True  # agentrl's env layer and env server go in too; False: the requirements alone (a library
    # whose pins agentrl's cannot live beside, driven by a script of its own)


def ensure(venv: Venv, cache: Path = CACHE) -> Path:
    """The virtualenv's folder, made first if it is not ready yet; its interpreter is `interpreter(folder)`."""
    python = find_python(venv.python)
    folder = cache / _key(venv, python)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if not (folder / "ready").exists():
            _create(folder, python, venv)
    return folder


def run_json(venv: Venv, args: Sequence[str], timeout: float = 600.0, env: dict[str, str] | None = None) -> Any:
    """The JSON on the last line of what `args` print, run by the venv's Python (made first if needed) with its
    `bin` first on PATH; its processes, whatever they started included, are killed when it ends or times out."""
    folder = ensure(venv)
    environ = {**os.environ, "PATH": f"{folder / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", **(env or {})}
    with tempfile.TemporaryDirectory(prefix="agentrl-venv-") as tmp:
        out, err = Path(tmp) / "out", Path(tmp) / "err"
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            group = ProcessGroup([str(interpreter(folder)), *args], stdout=stdout, stderr=stderr,
                                 stdin=subprocess.DEVNULL, env=environ)
            try:
                code = group.process.wait(timeout)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                group.kill()
        lines = out.read_text(errors="replace").strip().splitlines()
        if code != 0 or not lines:
            why = f"ran past {timeout:g} s" if code is None else f"exited {code}"
            raise VenvError(f"`{' '.join(args[:2])}` in {folder} {why}: {err.read_text(errors='replace')[-1500:]}")
        return json.loads(lines[-1])


def interpreter(folder: Path) -> Path:
    """The Python of the virtualenv in `folder`."""
    return folder / "bin" / "python"


def find_python(version: str) -> str:
    """An interpreter's path for `version`: "" (this one), a path, or "X.Y" on PATH or in pyenv's versions."""
    if not version:
        return sys.executable
    if os.sep in version:
        if not os.access(version, os.X_OK):
            raise VenvError(f"Python {version!r} is not an executable file")
        return version
    candidates = [shutil.which(f"python{version}"),
                  *sorted(Path("~/.pyenv/versions").expanduser().glob(f"{version}*/bin/python{version}"))]
    for candidate in filter(None, candidates):
        if subprocess.run([str(candidate), "-c", ""], capture_output=True).returncode == 0:  # a pyenv shim may not run
            return str(candidate)
    raise VenvError(f"No Python {version} on this machine (looked on PATH and in ~/.pyenv/versions): install it "
                    f"(`pyenv install {version}`, or your system's python{version} package) or give "
                    "Venv(python=...) an interpreter's path")


def _key(venv: Venv, python: str) -> str:
    files = {r: Path(r.split(None, 1)[1]).read_text() for r in venv.requirements if r.startswith("-r")}
    parts = [_python_version(python), venv.requirements, files, SERVER_REQUIREMENTS, OPENENV,
             metadata.version("agentrl")] + ([] if venv.serves else ["requirements alone"])
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _python_version(python: str) -> str:
    return subprocess.run([python, "-c", "import sys; print(sys.version)"], capture_output=True, text=True,
                          check=True).stdout.strip()


def _create(folder: Path, python: str, venv: Venv) -> None:
    shutil.rmtree(folder, ignore_errors=True)  # what a killed creation left
    print(f"agentrl: creating the env's virtualenv {folder} (once; pip's output in {folder}.log)", file=sys.stderr)
    with open(f"{folder}.log", "w") as log:
        def run(*args: str) -> None:
            log.write(f"\n$ {' '.join(args)}\n")
            log.flush()
            if subprocess.run(args, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
                tail = "\n".join(Path(f"{folder}.log").read_text(errors="replace").splitlines()[-25:])
                raise VenvError(f"making the env's virtualenv failed at `{' '.join(args)}` (log: {folder}.log):\n"
                                f"{tail}")

        run(python, "-m", "venv", str(folder))
        pip = (str(interpreter(folder)), "-m", "pip", "install", "--disable-pip-version-check")
        run(*pip, *_split(venv.requirements), *(SERVER_REQUIREMENTS if venv.serves else ()))
        if venv.serves:
            run(*pip, "--no-deps", OPENENV, *_agentrl_source())
    (folder / "ready").write_text(json.dumps({"python": python, "requirements": venv.requirements}))


def _split(requirements: tuple[str, ...]) -> list[str]:
    """pip's arguments for the requirements: an option with its value (`-r FILE`, `-e PATH`) as two."""
    return [part for r in requirements for part in (r.split(None, 1) if r.startswith("-") else [r])]


def _agentrl_source() -> list[str]:
    """pip's arguments that install this agentrl: its checkout (editable), the file it was installed from, or its
    release."""
    checkout = Path(agentrl.__file__).resolve().parent.parent
    if (checkout / "pyproject.toml").exists() and (checkout / "envs").is_dir():  # a checkout (make setup's layout)
        return ["-e", str(checkout)]
    dist = metadata.distribution("agentrl")
    url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    return [url[len("file://"):]] if url.startswith("file://") else [f"agentrl=={dist.version}"]
