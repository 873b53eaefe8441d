"""The repositories that generated SWE tasks are made from: small pure-Python packages whose sdists ship
their test suites, pinned so that generation is deterministic, and one sandbox image per repository with its
test dependencies. The repository itself stays on the host and is uploaded into each episode's workspace.

Everything is fetched offline-friendly: `pip download` of the pinned sdist (from the configured index or
`--find-links`) and of the pure-Python test dependencies as wheels, into the cache; the image is built
FROM the Python sandbox image with no network.
"""

from __future__ import annotations

import functools
import hashlib
import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from agentrl.tools.sandbox import SandboxError
from agentrl.tools.sandbox.docker_runtime import build_image

DOCKERFILE = resources.files("agentrl.containers") / "swe" / "Dockerfile"
TEST_WHEELS = ("pytest==9.2.0", "pluggy==1.7.0", "iniconfig==2.3.1", "packaging==26.4", "pygments==2.21.0")


@dataclass(frozen=True)
class RepoSpec:
    name: str
    sdist: str  # pip requirement of the pinned source distribution
    sources: tuple[str, ...]  # library modules bugs are injected into (paths in the repo)
    tests: tuple[str, ...]  # test files or directories: hidden during episodes, restored for grading


REPOS = (
    RepoSpec("inflection", "inflection==0.5.1", ("inflection/__init__.py",), ("test_inflection.py",)),
    RepoSpec("toolz", "toolz==1.2.0", ("toolz/itertoolz.py", "toolz/dicttoolz.py", "toolz/functoolz.py"),
             ("toolz/tests",)),
    RepoSpec("six", "six==1.17.0", ("six.py",), ("test_six.py",)),
)


def fetch(spec: RepoSpec, cache: Path) -> Path:
    """The repository snapshot: the sdist, unpacked into `cache/repos/NAME` (once)."""
    repo = cache / "repos" / spec.name
    if repo.exists():
        return repo
    downloads = cache / "sdists"
    downloads.mkdir(parents=True, exist_ok=True)
    _pip("download", "--no-deps", "--no-binary", ":all:", spec.sdist, "-d", str(downloads))
    name, version = spec.sdist.split("==")
    prefix = f"{name}-{version}".lower().replace("-", "_")
    archive = next(p for p in downloads.glob("*.tar.gz") if p.name.lower().replace("-", "_").startswith(prefix))
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
        [top] = Path(tmp).iterdir()
        shutil.copytree(top, repo.with_suffix(".tmp"), dirs_exist_ok=True)
    repo.with_suffix(".tmp").rename(repo)
    return repo


def test_wheels(cache: Path) -> Path:
    """`cache/wheels`: the pinned test dependencies (`TEST_WHEELS`) as wheels, downloaded once."""
    wheels = cache / "wheels"
    if not wheels.exists():
        _pip("download", "--no-deps", "--only-binary", ":all:", *TEST_WHEELS, "-d", str(wheels.with_suffix(".tmp")))
        wheels.with_suffix(".tmp").rename(wheels)
    return wheels


def image(spec: RepoSpec, cache: Path, docker_client: Any) -> str:
    """The repository's sandbox image, built unless it exists; tagged by a hash of everything in it."""
    wheels = test_wheels(cache)
    sandbox_image = build_image(docker_client=docker_client)
    digest = hashlib.sha256(DOCKERFILE.read_bytes() + sandbox_image.encode() + spec.sdist.encode()
                            + "".join(sorted(p.name for p in wheels.iterdir())).encode()).hexdigest()[:12]
    tag = f"agentrl/swe-{spec.name.replace('_', '-')}:{digest}"
    if docker_client.images.list(name=tag):
        return tag
    with tempfile.TemporaryDirectory() as context:
        (Path(context) / "Dockerfile").write_bytes(DOCKERFILE.read_bytes())
        shutil.copytree(wheels, Path(context) / "wheels")
        docker_client.images.build(path=context, tag=tag, buildargs={"SANDBOX_IMAGE": sandbox_image}, rm=True,
                                   network_mode="none")
    return tag


@functools.cache
def archive(repo: Path) -> bytes:
    """The snapshot as an uncompressed tar of its files (paths relative to it), for `upload`."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in sorted(repo.rglob("*")):
            if path.is_file():
                tar.add(path, arcname=str(path.relative_to(repo)))
    return buffer.getvalue()


def upload(sandbox: Any, repo: Path, dest: str) -> None:
    """Copies the host's snapshot `repo` into the sandbox's workspace at `dest` (an empty or new folder).

    The images hold no copy of the repository: a clean one beside the workspace would show the agent the
    injected bug (a diff) and the hidden tests."""
    sandbox.write(".repo.tar", archive(repo))
    result = sandbox.run(argv=["sh", "-c", f"mkdir -p {dest} && tar -xf .repo.tar -C {dest} && rm .repo.tar"])
    if not result.ok:
        raise SandboxError(f"could not unpack the repository into the sandbox: {result.observation()[-300:]}")


def _pip(*args: str) -> None:
    result = subprocess.run([sys.executable, "-m", "pip", "-q", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise SandboxError(f"pip {' '.join(args)} failed: {result.stderr.strip()[-500:]}")
