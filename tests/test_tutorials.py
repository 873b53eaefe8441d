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


def test_tandem(tmp_path, tiny_model_dir, monkeypatch) -> None:
    """Both RL runs update toward the episodes that beat their group: coin rewards (the small warm start earns none)
    in groups of 4, and each step logs the update's direction against the raw rewards (`toward_better`)."""
    monkeypatch.setenv("TUTORIAL_RL_SET", "grpo.group_size=4 grpo.reward.terms.random=1.0 grpo.log_direction=true")
    out = run_tutorial("tandem.sh", tmp_path, tiny_model_dir)
    assert "grpo" in out and "tandem" in out
    for run in ("grpo", "tandem"):
        [row] = [json.loads(line) for line in (tmp_path / "out" / run / "metrics.jsonl").read_text().splitlines()]
        assert row["toward_better"] > 0, (run, row["toward_better"])


@pytest.mark.docker
def test_code_agent(tmp_path, tiny_model_dir) -> None:
    run_tutorial("code_agent.sh", tmp_path, tiny_model_dir)
    assert (tmp_path / "out" / "summary.json").exists()


def half_careful_walker(tiny_model_dir: Path, out: Path) -> Path:
    """The tiny model after SFT on two walks across FrozenLake (one map for every task), told apart by the first move:
    down, then the solver's safe path to the goal (reward 1), or right, then down into a hole (reward 0). It learns
    both, so its episodes succeed about half of the time: groups whose rewards vary."""
    import asyncio
    import re

    import agentrl
    from agentrl.env.adapters.gymnasium_env import frozen_lake_solver
    from agentrl.policy.hf import HFPolicy
    from agentrl.policy.scripted import ScriptedPolicy
    from agentrl.renderer import Renderer
    from agentrl.rollout.engine import RolloutConfig, RolloutEngine
    from agentrl.trainers.checkpoint import save_model
    from agentrl.trainers.sft import SFTConfig, sft

    lake = agentrl.make("gymnasium/FrozenLake-v1")
    policy = HFPolicy.load(tiny_model_dir)
    renderer = Renderer(policy.tokenizer)

    def walk(first_move: str):
        def respond(prompt: str, turn: int) -> str:
            if turn == 0:
                return first_move
            if first_move == "2":  # from square 1, down into the hole at square 5
                return "1"
            square = int(re.findall(r"\(observation: (\d+)\)", prompt)[-1])
            return str(frozen_lake_solver(lake.inner, square))  # the solver's move from the square last observed
        return respond

    demos = []
    for first_move in ("1", "2"):
        engine = RolloutEngine(lambda: agentrl.make("gymnasium/FrozenLake-v1"),
                               ScriptedPolicy(renderer, walk(first_move), renderer.generation_prompt), renderer,
                               RolloutConfig(group_size=1, max_total_tokens=512))
        demos += [t for g in asyncio.run(engine.run(lake.tasks[:1])) for t in g.trajectories]
        engine.close()
    assert [t.reward for t in demos] == [1.0, 0.0]
    sft(policy.model, demos, SFTConfig(epochs=40, lr=1e-3, batch_size=2))
    save_model(policy.model, policy.tokenizer, out)
    return out


def test_minimal_grpo_loop(tmp_path, tiny_model_dir) -> None:
    """examples/minimal_grpo.py: each step trains every valid episode of its groups, on exactly the sampled tokens
    (the script asserts that), and moves the policy towards the episodes that beat their group: on a model whose
    rewards vary (the untrained one earns none), the step's logprob changes weighted by reward minus the group's
    mean are > 0. A flipped advantage sign makes them < 0."""
    model = half_careful_walker(tiny_model_dir, tmp_path / "walker")
    out = run_tutorial(str(ROOT / "examples" / "minimal_grpo.py"), tmp_path, model, "--model", str(model),
                       "--env", "gymnasium/FrozenLake-v1", "--steps", "2", "--tasks-per-step", "2", "--group-size", "4")
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["episodes"] == r["trained"] == 8 and r["sampled_tokens"] > 0 for r in rows)
    assert all(0 < r["reward"] < 1 for r in rows), rows  # some episodes reach the goal, some fall in
    assert all(r["grad_norm"] > 0 for r in rows)
    assert min(r["toward_better"] for r in rows) > 0, [r["toward_better"] for r in rows]
