"""Env workers on a local Ray cluster (2 worker processes): rollouts equal the in-process ones, and episodes
of a worker that dies are played again elsewhere, none lost or counted twice."""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
import time

import pytest
import ray

import agentrl
from agentrl.policy.protocol import Sample
from agentrl.policy.scripted import ScriptedPolicy, playing
from agentrl.rollout.buffer import GroupBuffer, RolloutSourceError, group_position, group_version
from agentrl.rollout.engine import EnvEngines, RolloutConfig, RolloutEngine
from agentrl.rollout.ray_pool import RayConfig, RayEnvPool, WorkerLost
from agentrl.rollout.ray_source import RaySources
from agentrl.rollout.timeline import Timeline
from agentrl.types import Status

ENV, KWARGS = "math/arith-v0", {"n_tasks": 12}
pytestmark = pytest.mark.slow  # every test here runs on the session's Ray cluster (seconds to start)


@pytest.fixture(scope="module")
def pool(ray_cluster):
    pool = RayEnvPool(ENV, KWARGS, RayConfig(workers=2))
    yield pool
    pool.close()


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


def gone(pid: int, within: float = 30.0) -> None:
    """Wait until process `pid` has ended."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise TimeoutError(f"process {pid} still runs {within:g} s after it was killed")


def answer(method, within: float = 120.0):
    """`method`'s result, once its actor answers: a worker Ray is restarting refuses calls until its new process is
    up (seconds; a minute on a loaded machine)."""
    deadline = time.monotonic() + within
    while True:
        try:
            return ray.get(method.remote())
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


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
            gone(killed[0])  # (the kill is asynchronous: a replay sent meanwhile to the dying process is lost too)

    remote = play(pool.make, renderer, kill_once)
    assert killed
    assert len(remote) == 24 and all(t.status == Status.OK for t in remote), [t.reason for t in remote]
    assert all(same(a, b) for a, b in zip(local, remote))  # replays give the same trajectories
    replayed = [t for t in remote if t.metrics.get("attempts", 1) > 1]
    assert replayed and all(t.metrics["attempts"] == 2 for t in replayed)
    assert answer(pool.workers[0].stats)["pid"] != killed[0]  # restarted in a new process


def test_a_new_env_tries_every_worker_once_while_other_threads_make_envs(monkeypatch):
    """Worker 0 is down; between this make's two tries another thread takes the next turn of the round robin.
    The make still reaches worker 1 (with the shared counter alone it tried worker 0 twice and failed)."""
    pool = RayEnvPool.__new__(RayEnvPool)
    pool.workers, pool._next = ["down", "up"], itertools.count()
    tried = []

    def remote_env(pool_, worker, episode, kwargs):
        tried.append(worker)
        if worker == "down":
            next(pool._next)  # another thread's make
            raise WorkerLost("env worker died: ActorUnavailableError: The actor is restarting")
        return worker

    monkeypatch.setattr("agentrl.rollout.ray_pool.RemoteEnv", remote_env)
    assert pool.make() == "up" and tried == ["down", "up"]


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
    assert t.status == Status.ERROR and t.reason.startswith("WorkerLost") and t.metrics["attempts"] == 3
    assert len(calls) == 3


def test_rollout_command_runs_envs_on_ray(ray_cluster, tiny_model_dir, tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    config = tmp_path / "rollout.toml"
    config.write_text(f"env = \"math/arith-v0\"\n[ray]\nworkers = 2\naddress = \"{ray_cluster}\"\n")
    out = tmp_path / "out.jsonl"
    agentrl_cli = str(Path(sys.executable).parent / "agentrl")  # this venv's, whether or not it is on PATH
    subprocess.run([agentrl_cli, "rollout", "--config", str(config), "--model", str(tiny_model_dir), "--n", "4",
                    "--max-tokens", "16", "--max-total-tokens", "512", "--out", str(out)], check=True, timeout=300)
    trajectories = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(trajectories) == 4 and all(t["status"] != "error" for t in trajectories), trajectories


def test_asynchronous_training_with_envs_on_ray(ray_cluster, tiny_model_dir, tmp_path):
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
address = "{ray_cluster}"
[grpo]
steps = 3
tasks_per_step = 2
lr = 1e-3
max_staleness = 1
group_size = 2
[grpo.rollout]
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


class Answers:
    """A policy that answers every turn with the same ids, for rollout sources in other processes: `sampling_copy`
    gives an actor its own, `sync_weights` only takes the version."""

    def __init__(self, ids: tuple[int, ...]):
        self.ids, self.weight_version = ids, 0

    async def generate(self, prompt_ids, sampling):
        return [Sample(self.ids, (-1.0,) * len(self.ids), "stop")] * sampling.n

    async def sync_weights(self, model, version):
        self.weight_version = version

    def sampling_copy(self):
        copy = Answers(self.ids)
        copy.weight_version = self.weight_version
        return copy

    async def close(self):
        pass


def sources_over(renderer, keep, tasks_at=None, count=2, tasks_per_step=4):
    """`count` rollout sources in Ray actors (the envs made in them) filling a trainer-side buffer."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors unpickle this module's policy
    tokenizer = renderer.tokenizer
    ids = tuple(tokenizer.encode("5", add_special_tokens=False)) + (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    tasks = list(agentrl.make(ENV, **KWARGS).tasks)
    buffer = GroupBuffer(keep, max_staleness=1, shares=count)
    sources = RaySources(count, EnvEngines(lambda: agentrl.make(ENV, **KWARGS)), Answers(ids), renderer,
                         RolloutConfig(group_size=2, max_turns=1), tasks_at or (lambda p: tasks[p % len(tasks)]),
                         buffer, tasks_per_step=tasks_per_step, seed=0, timeline=Timeline())
    return sources, buffer


def test_rollout_sources_in_ray_actors_keep_the_staleness_bound_and_the_versions(ray_cluster, renderer):
    """Two sources in actors, each playing every other task position; the trainer's buffer refuses the groups of
    positions 1, 5, 9, ... (all source 1's). With no sync, the sources stop once each has its share of two steps
    kept in the buffer (the refused ones counted back to source 1 and played again by others); a sync lets them
    run one step further, the groups started after it carry the new version, and their busy intervals reach the
    trainer's timeline."""
    refused = lambda p: p % 4 == 1  # noqa: E731
    sources, buffer = sources_over(renderer, lambda g: not refused(group_position(g)))
    sources.start()
    try:
        deadline = time.monotonic() + 60
        while buffer.ready() < 8 or sources.in_flight:
            assert time.monotonic() < deadline, (buffer.ready(), sources.in_flight)
            time.sleep(0.05)
        time.sleep(1.0)
        assert buffer.ready() == 8 and sources.in_flight == 0  # (0 syncs + staleness 1 + 1) steps of 4 tasks
        first = buffer.take(4, version=0)
        assert any(refused(p) for p in first.done) and buffer.discarded[1] >= 1 and buffer.discarded[0] == 0
        sources.sync(None, 1)
        second = buffer.take(4, version=1)
        deadline = time.monotonic() + 60
        while buffer.ready() < 1:  # a group played with version 1 before the next sync, on a loaded machine too
            assert time.monotonic() < deadline, buffer.ready()
            time.sleep(0.05)
        sources.sync(None, 2)
        third = buffer.take(4, version=2)
        busy = sources.timeline.cut()
    finally:
        sources.close()
    kept = [group_position(g) for taken in (first, second, third) for g in taken.kept]
    assert len(kept) == len(set(kept)) == 12 and not any(refused(p) for p in kept)
    assert sorted(p % 2 for p in kept[:8]) == [0] * 4 + [1] * 4  # before the first sync: each source its share
    assert {group_version(g) for g in first.kept + second.kept} == {0}  # played before the first sync
    third_versions = {t.weight_version for g in third.kept for t in g.trajectories}
    assert 1 in third_versions and third_versions <= {1, 2} and not third.stale  # stamped by the resumed sources
    assert busy["engine"] and busy["env"] and all(0 <= a <= b <= sources.timeline.now() for a, b in busy["env"])
    assert not any(pump.is_alive() for pump in sources._pumps)


def test_a_rollout_source_that_fails_or_dies_fails_the_trainers_take(ray_cluster, renderer):
    def task_at(position):
        if position == 3:
            raise LookupError("no task at position 3")
        return agentrl.make(ENV, **KWARGS).tasks[position]

    sources, buffer = sources_over(renderer, lambda g: True, task_at)
    sources.start()
    try:
        with pytest.raises(RolloutSourceError, match="no task at position 3"):
            buffer.take(8, version=0)
    finally:
        sources.close()

    sources, buffer = sources_over(renderer, lambda g: True)
    sources.start()
    try:
        buffer.take(2, version=0)
        ray.kill(sources.actors[1])
        with pytest.raises(RolloutSourceError, match="rollout source 1's actor died"):
            buffer.take(8, version=0)
    finally:
        sources.close()
