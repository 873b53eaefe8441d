"""Env workers on a local Ray cluster (2 worker processes): rollouts equal the in-process ones, and episodes
of a worker that dies are played again elsewhere, none lost or counted twice."""

from __future__ import annotations

import asyncio

import pytest
import ray
from transformers import AutoTokenizer

import agentrl
from agentrl.rollout.ray_pool import RayConfig, RayEnvPool, WorkerLost, init_ray
from agentrl.renderer import Renderer
from agentrl.rollout.engine import RolloutConfig, RolloutEngine
from agentrl.policy.scripted import ScriptedPolicy, playing
from agentrl.types import Status

ENV, KWARGS = "math/arith-v0", {"n_tasks": 12}


@pytest.fixture(scope="module")
def pool():
    init_ray()
    pool = RayEnvPool(ENV, KWARGS, RayConfig(workers=2))
    yield pool
    pool.close()
    ray.shutdown()


@pytest.fixture(scope="module")
def renderer(tiny_model_dir):
    return Renderer(AutoTokenizer.from_pretrained(tiny_model_dir))


def play(make_env, renderer, on_turn=None):
    env = agentrl.make(ENV, **KWARGS)
    respond = playing({t.data["question"]: env.gold_actions(t) for t in env.tasks})

    def scripted(prompt: str, turn: int) -> str:
        if on_turn:
            on_turn(prompt, turn)
        return respond(prompt, turn)

    policy = ScriptedPolicy(renderer, scripted, "<|im_start|>assistant")
    engine = RolloutEngine(make_env, policy, renderer, RolloutConfig(group_size=2, concurrency=8, seed=3))
    try:
        return [t for g in asyncio.run(engine.run(list(env.tasks))) for t in g.trajectories]
    finally:
        engine.close()


def same(a, b) -> bool:
    return (a.task_id, a.token_ids, a.loss_mask, a.reward, a.status, a.seed) == \
        (b.task_id, b.token_ids, b.loss_mask, b.reward, b.status, b.seed)


def test_remote_envs_give_the_in_process_trajectories(pool, renderer):
    local = play(lambda: agentrl.make(ENV, **KWARGS), renderer)
    remote = play(pool.make, renderer)
    assert len(remote) == 24 and all(t.status == Status.OK and t.reward == 1.0 for t in remote)
    assert all(same(a, b) for a, b in zip(local, remote))
    hosted = ray.get([w.stats.remote() for w in pool.workers])
    assert all(h["opened"] >= 12 for h in hosted), hosted  # round robin: both workers played
    assert len({h["pid"] for h in hosted}) == 2  # in two processes


def test_remote_env_forwards_attributes_and_errors(pool):
    env = pool.make()
    assert env.max_reward == agentrl.make(ENV, **KWARGS).max_reward
    assert len(env.tasks) == 12 and env.check_step("2 + 3 = 5") is True
    with pytest.raises(TypeError, match="options\\['task'\\] must be an agentrl Task"):
        env.reset(seed=0, options={"task": "not a task"})  # the env's own exception, as in-process
    env.close()


def test_a_dead_worker_loses_nothing(pool, renderer):
    local = play(lambda: agentrl.make(ENV, **KWARGS), renderer)
    killed = []

    def kill_once(prompt: str, turn: int) -> None:
        if turn == 1 and not killed:  # mid-episode: episodes on worker 0 are between two env calls
            killed.append(ray.get(pool.workers[0].stats.remote())["pid"])
            ray.kill(pool.workers[0], no_restart=False)  # as if its process died; Ray restarts it

    remote = play(pool.make, renderer, kill_once)
    assert killed
    assert len(remote) == 24 and all(t.status == Status.OK for t in remote), [t.reason for t in remote]
    assert all(same(a, b) for a, b in zip(local, remote))  # replays give the same trajectories
    replayed = [t for t in remote if t.info.get("attempts", 1) > 1]
    assert replayed and all(t.info["attempts"] == 2 for t in replayed)
    assert ray.get(pool.workers[0].stats.remote())["pid"] != killed[0]  # restarted in a new process


def test_retries_are_bounded(pool):
    """A worker that keeps dying: the episode ends as `error` after 1 + retries plays, with the reason."""
    class Dying:
        max_reward = 1.0

        def reset(self, **kwargs):
            raise WorkerLost("env worker died: ActorDiedError")

        def close(self):
            pass

    calls = []
    engine = RolloutEngine(lambda: calls.append(1) or Dying(), None, None, RolloutConfig(retries=2))
    engine.policy = type("P", (), {"weight_version": 0})()
    task = agentrl.make(ENV, **KWARGS).tasks[0]
    t = asyncio.run(engine.run_episode(task, 0, 0))
    engine.close()
    assert t.status == Status.ERROR and t.reason.startswith("WorkerLost") and t.info["attempts"] == 3
    assert len(calls) == 3


def test_rollout_command_runs_envs_on_ray(tiny_model_dir, tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    config = tmp_path / "rollout.toml"
    config.write_text("env = \"math/arith-v0\"\n[ray]\nworkers = 2\n")
    out = tmp_path / "out.jsonl"
    agentrl_cli = str(Path(sys.executable).parent / "agentrl")  # this venv's, whether or not it is on PATH
    subprocess.run([agentrl_cli, "rollout", "--config", str(config), "--model", str(tiny_model_dir), "--n", "4",
                    "--max-tokens", "16", "--max-total-tokens", "512", "--out", str(out)], check=True, timeout=300)
    trajectories = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(trajectories) == 4 and all(t["status"] != "error" for t in trajectories), trajectories


def test_asynchronous_training_with_envs_on_ray(tiny_model_dir, tmp_path):
    """`max_staleness = 1` with the envs in Ray workers: the rollout source only sees `make_env`, so the async loop
    runs over remote envs as over local ones; every trained group is at most one version old, none in error."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    recipe = tmp_path / "train.toml"
    recipe.write_text(f"""
env = "math/arith-v0"
model = "{tiny_model_dir}"
out_dir = "{tmp_path / 'run'}"
env_kwargs = {{ n_tasks = 8 }}
[ray]
workers = 2
[grpo]
steps = 3
tasks_per_step = 2
lr = 1e-3
max_staleness = 1
[grpo.rollout]
group_size = 2
[grpo.rollout.sampling]
max_tokens = 8
""")
    agentrl_cli = str(Path(sys.executable).parent / "agentrl")
    done = subprocess.run([agentrl_cli, "train", str(recipe)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["groups_trained"] for r in rows] == [2, 2, 2]
    assert all(set(r["staleness"]) <= {"0", "1"} for r in rows)
    assert all(r["error_frac"] == 0 for r in rows), [r["status"] for r in rows]
