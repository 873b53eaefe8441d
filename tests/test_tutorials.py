"""Every tutorial of the documentation runs as written (docs/tutorials/*.md include these scripts).

The shell tutorials run with TUTORIAL_SMALL=1, which shrinks steps and task counts through `--set`; the
commands are the ones the pages show."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = ROOT / "examples" / "tutorials"
pytestmark = pytest.mark.slow


def run_tutorial(name: str, tmp_path: Path, model: Path, *args: str, timeout: float = 900) -> str:
    env = dict(os.environ, TUTORIAL_SMALL="1", OUT=str(tmp_path / "out"), MODEL=str(model),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    command = ["bash", str(TUTORIALS / name)] if name.endswith(".sh") else [sys.executable, str(TUTORIALS / name)]
    done = subprocess.run([*command, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_custom_env(tmp_path, tiny_model_dir) -> None:
    out = run_tutorial("custom_env.py", tmp_path, tiny_model_dir, "--model", str(tiny_model_dir))
    assert "check: passed" in out and "(episode over) (reward 1.0)" in out
    assert out.count("tokens sampled") == 4


def test_new_loss(tmp_path, tiny_model_dir) -> None:
    out = run_tutorial("new_loss.py", tmp_path, tiny_model_dir, "--model", str(tiny_model_dir), "--steps", "1",
                       "--out", str(tmp_path / "run"))
    assert "hand-worked example: loss -0.249533" in out
    assert (tmp_path / "run" / "summary.json").exists()


def test_search_agent(tmp_path) -> None:
    # the tutorial builds its own model (the tokenizer also learns the search corpus), not the shared one
    out = run_tutorial("search_agent.sh", tmp_path, tmp_path / "tiny-search")
    assert "'before'" in out and "'after'" in out


def test_evaluate(tmp_path, tiny_model_dir) -> None:
    run_tutorial("evaluate.sh", tmp_path, tiny_model_dir)
    for name in ("report.md", "report.html", "viewer.html"):
        assert (tmp_path / "out" / name).exists(), name


def test_tandem(tmp_path, tiny_model_dir) -> None:
    out = run_tutorial("tandem.sh", tmp_path, tiny_model_dir)
    assert "grpo" in out and "tandem" in out


@pytest.mark.docker
def test_code_agent(tmp_path, tiny_model_dir) -> None:
    run_tutorial("code_agent.sh", tmp_path, tiny_model_dir)
    assert (tmp_path / "out" / "summary.json").exists()


def test_minimal_grpo_loop(tmp_path, tiny_model_dir) -> None:
    """examples/minimal_grpo.py: each step trains every valid episode of its groups, on exactly the sampled tokens
    (the script asserts that). The untrained tiny model earns no arithmetic reward, so the advantages, the loss
    and the gradient are exactly 0: with no signal, no update."""
    out = run_tutorial(str(ROOT / "examples" / "minimal_grpo.py"), tmp_path, tiny_model_dir, "--model",
                       str(tiny_model_dir), "--steps", "2", "--tasks-per-step", "2", "--group-size", "4")
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["episodes"] == r["trained"] == 8 and r["sampled_tokens"] > 0 for r in rows)
    assert all(r["reward"] == r["loss"] == r["grad_norm"] == 0.0 for r in rows)
