"""A built wheel works without the checkout: every module and data file, every env id, the sandbox's files.

The wheel goes into a fresh venv of its own; the dependencies come from this venv's site-packages through a
`.pth` line (the editable install here is a finder that such a line does not run, so only the wheel's
`agentrl` is importable there), and the checks run from a folder outside the checkout.
"""

from __future__ import annotations

import json
import shutil
import site
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest


pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]

CHECK = textwrap.dedent("""
    import json, sys
    from importlib.metadata import entry_points
    import agentrl
    from agentrl.env.registry import registry
    from agentrl.tools.sandbox import docker_runtime
    from agentrl.envs.swe import repos
    from agentrl.models import tiny
    from agentrl.eval import report

    loaded = {}
    for env_id, spec in registry().items():
        loaded[env_id] = spec.load().__module__
    plugins = {ep.name: ep.load().__module__ for ep in entry_points(group="vllm.general_plugins")}
    print(json.dumps({
        "agentrl": agentrl.__file__, "loaded": loaded, "plugins": plugins,
        "sandbox_tag": docker_runtime.image_tag(),
        "files": [str(p) for p in (docker_runtime.DOCKERFILE, repos.DOCKERFILE, tiny.TEMPLATE_PATH,
                                   docker_runtime.CONTAINERS / "build-base.sh",
                                   docker_runtime.CONTAINERS / "start-dockerd.sh",
                                   report.TEMPLATES / "report.html.jinja", report.TEMPLATES / "viewer.html.jinja")
                  if p.is_file()],
    }))
""")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of the files git would commit, built in a copy (a checkout's stale build/ folder would hide a
    package that the build leaves out)."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(source)], check=True, capture_output=True)
    [built] = out.glob("agentrl-*.whl")
    return built


def test_the_wheel_holds_every_module_and_data_file_of_the_checkout(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = set()
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in package_dir.items():
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                expected.add("/".join((*package.split("."), *path.relative_to(ROOT / folder).parts)))
    assert expected - names == set()


def test_an_installed_wheel_loads_every_env_and_finds_its_files(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-deps", str(wheel)], check=True, capture_output=True)
    [purelib] = (venv / "lib").glob("python3*/site-packages")
    (purelib / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = subprocess.run([str(venv / "bin" / "python"), "-c", CHECK], cwd=elsewhere, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout.splitlines()[-1])
    assert found["agentrl"].startswith(str(purelib)), found["agentrl"]  # the wheel's, not the checkout's
    checkout = subprocess.run([sys.executable, "-c", "import json; from agentrl.env.registry import registry; "
                               "print(json.dumps(sorted(registry())))"], capture_output=True, text=True, check=True)
    assert sorted(found["loaded"]) == json.loads(checkout.stdout)  # the ids the checkout registers, every one loaded
    assert found["plugins"]["agentrl_weight_transfer"] == "agentrl.policy.weight_transfer"
    assert len(found["files"]) == 7 and all(f.startswith(str(purelib)) for f in found["files"]), found["files"]
    from agentrl.tools.sandbox.docker_runtime import image_tag

    assert found["sandbox_tag"] == image_tag()  # the same Dockerfile and runner as the checkout's
    help_text = subprocess.run([str(venv / "bin" / "agentrl"), "--help"], cwd=elsewhere, capture_output=True,
                               text=True, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert help_text.returncode == 0 and "envs" in help_text.stdout, help_text.stderr
