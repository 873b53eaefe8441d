"""`run_suite` and `agentrl eval`: the tiny model on a two-env suite; an interrupted eval, resumed, ends with
exactly the episodes and results of an uninterrupted one."""

import json

import pytest
from typer.testing import CliRunner

from agentrl.cli.main import app
from agentrl.eval.run import EvalRunMismatch, run_suite
from agentrl.policy.hf import HFPolicy
from agentrl.policy.protocol import SamplingParams
from agentrl.renderer import Renderer
from agentrl.rollout.engine import RolloutConfig
from agentrl.rollout.jsonl import read_jsonl
from agentrl.env.suites import Suite, SuiteEntry
from agentrl.models.tokenizer import load_tokenizer

SUITE = Suite("test/eval", (SuiteEntry("math/arith-v0", "heldout", 3),
                            SuiteEntry("search/r1-v0", "more_hops", 2, {"topk": 1})))
CONFIG = RolloutConfig(max_total_tokens=768, concurrency=4, seed=3,
                       sampling=SamplingParams(max_tokens=24, temperature=1.0))
KS = (1, 2)
EPISODES = (3 + 2) * 2


class Interrupt(Exception):
    pass


def without_wall_time(value):
    """Results minus wall-clock seconds, the one thing two identical runs do not share."""
    if isinstance(value, dict):
        return {k: without_wall_time(v) for k, v in value.items() if k != "seconds"}
    return value


def episodes(run_dir):
    return {(t.logs["entry"], t.task_id, t.logs["sample"]): t.token_ids for t in read_jsonl(run_dir / "trajectories.jsonl")}


@pytest.fixture(scope="module")
def policy_and_renderer(tiny_model_dir):
    return HFPolicy.load(tiny_model_dir), Renderer(load_tokenizer(tiny_model_dir))


@pytest.mark.slow
def test_interrupted_eval_resumes_to_the_same_results(tmp_path, tiny_model_dir, policy_and_renderer):
    policy, renderer = policy_and_renderer
    whole = run_suite(SUITE, policy, renderer, tmp_path / "whole", tiny_model_dir, KS, config=CONFIG)
    assert whole["all"]["episodes"] == EPISODES and set(whole["entries"]) == {e.name for e in SUITE.entries}

    seen = []

    def killed_after_four(t):
        seen.append(t)
        if len(seen) == 4:
            raise Interrupt

    cut = tmp_path / "cut"
    with pytest.raises(Interrupt):
        run_suite(SUITE, policy, renderer, cut, tiny_model_dir, KS, config=CONFIG, on_episode=killed_after_four)
    finished = len(episodes(cut))
    assert 4 <= finished < EPISODES
    with open(cut / "trajectories.jsonl", "ab") as f:
        f.write('{"task_id": "half a line, cut inside a character: é'.encode()[:-1])  # what a kill mid-write leaves

    rerun = []
    resumed = run_suite(SUITE, policy, renderer, cut, tiny_model_dir, KS, config=CONFIG, on_episode=rerun.append)
    assert len(rerun) == EPISODES - finished  # nothing finished was redone
    assert episodes(cut) == episodes(tmp_path / "whole")  # the same tokens, episode for episode
    assert without_wall_time(resumed) == without_wall_time(whole)
    assert json.loads((cut / "run.json").read_text())["finished"]


def test_a_run_directory_refuses_other_settings(tmp_path, tiny_model_dir, policy_and_renderer):
    policy, renderer = policy_and_renderer
    small = Suite("test/small", (SuiteEntry("math/arith-v0", "heldout", 1),))
    config = RolloutConfig(max_total_tokens=256, sampling=SamplingParams(max_tokens=8, temperature=0.0))
    run_suite(small, policy, renderer, tmp_path, tiny_model_dir, (1,), config=config)
    with pytest.raises(EvalRunMismatch, match="other k, n"):
        run_suite(small, policy, renderer, tmp_path, tiny_model_dir, (1, 2), config=config)


def test_eval_command_writes_results_report_and_viewer(tmp_path, tiny_model_dir):
    suite = tmp_path / "suite.toml"
    suite.write_text('name = "test/cli"\n[[entries]]\nenv = "math/arith-v0"\nsplit = "heldout"\nn_tasks = 2\n')
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["eval", "--suite", str(suite), "--model", tiny_model_dir, "--out", str(out),
                                      "--max-tokens", "16", "--max-total-tokens", "512"])
    assert result.exit_code == 0, result.output
    assert "math/arith-v0:heldout" in result.output and "pass@1" in result.output
    for name in ("run.json", "trajectories.jsonl", "results.json", "report.md", "report.html", "viewer.html"):
        assert (out / name).exists(), name
    assert json.loads((out / "results.json").read_text())["all"]["episodes"] == 2
    bad = CliRunner().invoke(app, ["eval", "--suite", "nope/none", "--model", tiny_model_dir])
    assert bad.exit_code == 2 and "No suite 'nope/none'" in bad.output


@pytest.mark.slow
def test_evaluation_killed_at_random_points_resumes_to_the_uninterrupted_run(tmp_path, tiny_model_dir):
    """`agentrl eval` SIGKILLed mid-run, again and again: every rerun resumes, and the last one's episodes are
    the uninterrupted run's, each exactly once (a line cut by a kill is repaired, never lost or doubled)."""
    import random
    import signal
    import subprocess
    import sys
    import time

    from agentrl.rollout.jsonl import read_records

    suite = tmp_path / "suite.toml"
    suite.write_text('name = "test/kill"\n[[entries]]\nenv = "math/arith-v0"\nsplit = "heldout"\nn_tasks = 12\n')
    command = [sys.executable, "-m", "agentrl.cli.main", "eval", "--suite", str(suite), "--model", str(tiny_model_dir),
               "--n", "12", "--k", "1,2", "--concurrency", "2", "--max-tokens", "24", "--max-total-tokens", "512"]
    assert subprocess.run([*command, "--out", str(tmp_path / "straight")], capture_output=True).returncode == 0
    out, rng, kills = tmp_path / "killed", random.Random(0), 0

    def lines() -> int:
        path = out / "trajectories.jsonl"
        return path.read_bytes().count(b"\n") if path.exists() else 0

    for _ in range(5):
        run, done = subprocess.Popen([*command, "--out", str(out)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL), lines()
        while run.poll() is None and lines() == done:  # an episode's progress first
            time.sleep(0.02)
        time.sleep(rng.uniform(0, 0.5))
        if run.poll() is not None:
            break
        run.send_signal(signal.SIGKILL)
        run.wait()
        kills += 1
    assert subprocess.run([*command, "--out", str(out)], capture_output=True).returncode == 0
    assert kills >= 2

    def keyed(run_dir):
        records = read_records(run_dir / "trajectories.jsonl")
        keys = [(r["logs"]["entry"], r["task_id"], r["logs"]["sample"]) for r in records]
        assert len(keys) == len(set(keys)) == 24, run_dir  # every episode, once
        return {k: r["token_ids"] for k, r in zip(keys, records)}

    assert keyed(out) == keyed(tmp_path / "straight")
