"""An agentrl env in another process (`agentrl.env.remote`): the whole TextEnv API through its server, and an env in
a virtualenv of its own (`register(..., venv=Venv(...))`), whose dependencies the trainer's venv cannot hold: made
once, its server started on first use, ended with the job (SIGKILL included), a dead server an `error` episode."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy
import pytest
import uvicorn
from fastapi import FastAPI

import agentrl
from agentrl.env import remote
from agentrl.env.adapters.openenv_server import build_app
from agentrl.env.remote import RemoteEnv, RemoteEnvError
from agentrl.env.venvs import Venv, VenvError, ensure, find_python
from agentrl.policy.scripted import ScriptedPolicy
from agentrl.rollout.engine import RolloutConfig, RolloutEngine
from agentrl.system.tcp import listening_socket
from agentrl.types import Message, Status, StopReason

PROBE = Path(__file__).parent / "data" / "venv_probe_env"
PROBE_VENV = Venv(python="3.12", requirements=(f"-e {PROBE}",))


def serve(app):
    """`app` on a free loopback port, in a thread of this process; yields its URL."""
    sock = listening_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="module")
def math_url():
    server, thread, url = serve(build_app("math/arith-v0", max_sessions=8, n_tasks=16))
    yield url
    server.should_exit = True
    thread.join(10)


def play(make_env, renderer, tasks, respond):
    """Episodes of `tasks` through the rollout engine, each turn from `respond(env, turn)`."""
    made = []

    def make():
        made.append(make_env())
        return made[-1]

    policy = ScriptedPolicy(renderer, lambda prompt, turn: respond(made[-1], turn), "<|im_start|>assistant")
    engine = RolloutEngine(make, policy, renderer, RolloutConfig(concurrency=1, max_turns=8, max_total_tokens=4096))
    try:
        return [g.trajectories[0] for g in asyncio.run(engine.run(tasks))]
    finally:
        engine.close()


def test_a_served_env_is_the_same_env_through_its_server(math_url, renderer):
    """RemoteEnv against `agentrl serve env`'s app: the same tasks, tools, first messages, gold actions, rewards,
    parsed actions and tokens as the env in this process."""
    local, served = agentrl.make("math/arith-v0", n_tasks=16), RemoteEnv(math_url)
    assert [t.id for t in served.tasks] == [t.id for t in local.tasks]
    assert [t.data for t in served.tasks] == [t.data for t in local.tasks]
    assert served.tool_schemas == local.tool_schemas and served.max_reward == local.max_reward
    assert served.difficulty(served.tasks[3]) == local.difficulty(local.tasks[3])
    task = served.tasks[3]
    assert served.gold_actions(task) == list(local.gold_actions(local.tasks[3]))
    obs, info = served.reset(options={"task": task})
    assert obs == tuple(local.first_messages(local.tasks[3])) and info["tools"] == local.tool_schemas
    local.reset(options={"task": local.tasks[3]})
    for action in served.gold_actions(task):
        theirs, ours = served.step(action), local.step(action)
        assert theirs[:4] == ours[:4]
        info = {k: v for k, v in ours[4].items() if k != "assistant"}
        assert theirs[4] == {**json.loads(json.dumps(info, default=str)), "assistant": ours[4]["assistant"]}
    served.close()
    assert served.validate(4) == [] and local.validate(4) == []

    gold = lambda env, turn: env.gold_actions(env.task)[turn]  # noqa: E731
    theirs = play(lambda: RemoteEnv(math_url), renderer, list(served.tasks)[:3], gold)
    ours = play(lambda: agentrl.make("math/arith-v0", n_tasks=16), renderer, list(local.tasks)[:3], gold)
    assert [t.reward for t in theirs] == [t.reward for t in ours] == [1.0] * 3
    assert [t.token_ids for t in theirs] == [t.token_ids for t in ours]
    assert [t.loss_mask for t in theirs] == [t.loss_mask for t in ours]


def test_a_server_of_another_agentrl_is_refused():
    app = FastAPI()
    app.get("/agentrl/env")(lambda split="train": {"version": "0.0.1", "max_reward": 1.0, "max_turns": 2,
                                                   "tools": [], "tasks": []})
    server, thread, url = serve(app)
    try:
        with pytest.raises(RemoteEnvError, match=r"runs agentrl 0\.0\.1, this process .*install the same agentrl"):
            RemoteEnv(url)
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_missing_python_says_how_to_get_one():
    with pytest.raises(VenvError, match=r"No Python 2\.1 on this machine.*pyenv install 2\.1"):
        find_python("2.1")


# ---- an env in its own virtualenv (Python 3.12, numpy 1.x; this venv: Python 3.11, numpy 2) ----

def register_probe(name: str, entry_point: str = "venv_probe_env:ProbeEnv", **kwargs) -> str:
    agentrl.register(name, entry_point, venv=PROBE_VENV, **kwargs)
    return name


@pytest.mark.slow
def test_an_env_in_its_own_venv_plays_and_checks():
    """The env's first message says where it runs: Python 3.12 and numpy 1.x, which this process cannot import."""
    assert numpy.__version__.startswith("2.") and sys.version_info[:2] == (3, 11)
    env = agentrl.make(register_probe("test/probe-v0"))
    assert [t.id for t in env.tasks] == [f"probe/train/{w}" for w in ("apple", "birch", "cedar", "delta")]
    assert env.tool_schemas[0]["function"]["name"] == "say" and env.difficulty(env.tasks[1]) == {"letters": 5}
    obs, _ = env.reset(options={"task": env.tasks[1]})
    assert "python 3.12, numpy 1." in obs[0].content and obs[0].content.endswith("Say 'birch'.")
    assert env.step("pine")[:4] == ((Message("user", "No."),), 0.0, False, False)
    observation, reward, terminated, truncated, info = env.step("birch")
    assert (observation, reward, terminated, truncated) == ((), 1.0, True, False)
    assert info["answer"] == "birch" and info["assistant"] == Message("assistant", "birch")
    env.close()
    assert agentrl.check("test/probe-v0", n_tasks=4) == []
    heldout = agentrl.make("test/probe-v0", split="heldout", words=["oak"])  # kwargs reach the env there
    assert [t.id for t in heldout.tasks] == ["probe/heldout/oak"]


@pytest.mark.slow
def test_the_venv_is_made_once():
    first = ensure(PROBE_VENV)
    ready = (first / "ready").stat().st_mtime
    began = time.monotonic()
    assert ensure(PROBE_VENV) == first and (first / "ready").stat().st_mtime == ready
    assert time.monotonic() - began < 10  # found, not built: a build takes minutes


@pytest.mark.slow
def test_a_dead_server_is_an_error_episode_and_the_next_starts_it_again(renderer):
    name = register_probe("test/probe-crash-v0")
    tasks = list(agentrl.make(name).tasks)[:2]

    def respond(env, turn):  # the first task's action kills its server
        return "crash" if env.task.id == tasks[0].id else env.gold_actions(env.task)[0]

    crashed, after = play(lambda: agentrl.make(name), renderer, tasks, respond)
    assert (crashed.status, crashed.stop) == (Status.ERROR, StopReason.ENV_ERROR)
    assert "the env server died (exit code 3" in crashed.reason
    assert after.status == Status.OK and after.reward == 1.0  # a new server


@pytest.mark.slow
def test_a_server_that_cannot_start_says_why():
    with pytest.raises(RemoteEnvError, match=r"(?s)did not start: exit code 1.*AttributeError.*NoSuchEnv"):
        agentrl.make(register_probe("test/probe-missing-v0", "venv_probe_env:NoSuchEnv"))


@pytest.mark.slow
def test_a_server_that_hangs_at_start_is_stopped(monkeypatch):
    monkeypatch.setattr(remote, "STARTUP_TIMEOUT", 3.0)
    name = register_probe("test/probe-hang-v0", delay=60)  # the env's constructor sleeps
    with pytest.raises(RemoteEnvError, match=r"did not start: not listening after 3 s"):
        agentrl.make(name)


@pytest.mark.slow
def test_the_server_ends_when_its_job_is_sigkilled(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        import agentrl
        from agentrl.env.venvs import Venv
        agentrl.register("test/probe-v0", "venv_probe_env:ProbeEnv", venv=Venv(python="3.12",
                         requirements=({f"-e {PROBE}"!r},)))
        env = agentrl.make("test/probe-v0")
        obs, _ = env.reset(options={{"task": env.tasks[0]}})
        print(obs[0].content.split("pid ")[1].split("]")[0], flush=True)
        time.sleep(600)
    """)
    job = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    server_pid = int(job.stdout.readline())
    os.kill(server_pid, 0)  # running
    job.send_signal(signal.SIGKILL)
    job.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    pytest.fail(f"the env server (pid {server_pid}) outlived its SIGKILLed job by 20 s")
