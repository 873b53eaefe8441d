"""Harbor tasks (`harbor/tasks-v0`): three task folders in tests/data/harbor_tasks, one of them Harbor's own template
(`harbor init --task`, separate verifier, artifacts), two written here (a shared verifier with reward.txt, and
reward.json with a verifier env); built offline, played in their own image, graded by their own test.sh in a fresh
container; and checked by `harbor lint` itself, in its own Python 3.12 virtualenv."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import agentrl
from agentrl.env.venvs import Venv, ensure
from agentrl.envs.harbor.box import offline_from
from agentrl.envs.harbor.task import HarborTaskError, dockerfile_workdir, find_tasks
from agentrl.tools.parsers import HermesParser
from agentrl.types import ToolCall

TASKS = Path(__file__).parent / "data" / "harbor_tasks"
NAMES = ["agentrl/count-errors", "agentrl/fix-mean", "agentrl/hello-world"]


def call(name: str, **arguments) -> str:
    return HermesParser().format_call(ToolCall(name, arguments))


def play(task_name: str, *actions: str, **kwargs):
    """The env's steps for `actions` on the task; the last step's (reward, terminated, info)."""
    env = agentrl.make("harbor/tasks-v0", tasks=str(TASKS), **kwargs)
    env.reset(options={"task": next(t for t in env.tasks if t.id == task_name)})
    try:
        for action in actions:
            _, reward, terminated, truncated, info = env.step(action)
        return reward, terminated or truncated, info
    finally:
        env.close()


# ---- reading task folders (no Docker) ----

def test_task_folders_read_as_harbor_resolves_them():
    tasks = {t.name: t for t in find_tasks(TASKS)}
    assert sorted(tasks) == NAMES
    hello, count, fix = tasks["agentrl/hello-world"], tasks["agentrl/count-errors"], tasks["agentrl/fix-mean"]
    assert hello.separate_verifier and hello.artifacts == ["/app/hello.txt"] and hello.workdir == "/app"
    assert not count.separate_verifier and not fix.separate_verifier  # explicit "shared", and the default
    assert fix.timeout("verifier", 600.0) == 60.0 and hello.timeout("agent", 1.0) == 600.0
    assert hello.instruction.startswith("Create a file `hello.txt`")


def test_unsupported_task_folders_say_why(tmp_path):
    with pytest.raises(HarborTaskError, match="no Harbor task"):
        find_tasks(tmp_path)
    task = tmp_path / "t"
    (task / "environment").mkdir(parents=True)
    (task / "task.toml").write_text('[task]\nname = "x"\n')
    with pytest.raises(HarborTaskError, match="no instruction.md, environment/Dockerfile, tests/test.sh"):
        find_tasks(tmp_path)
    (task / "instruction.md").write_text("do it")
    (task / "environment" / "Dockerfile").write_text("FROM debian\n")
    (task / "tests").mkdir()
    (task / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    (task / "task.toml").write_text('[[steps]]\nname = "one"\n')
    with pytest.raises(HarborTaskError, match=r"multi-step tasks \(\[\[steps\]\]\) are not supported"):
        find_tasks(tmp_path)


def test_offline_from_replaces_only_what_cannot_be_pulled():
    dockerfile = ("ARG BASE=python:3.12\nFROM ubuntu:24.04 AS build\nRUN make\nFROM --platform=linux/amd64 local:1\n"
                  "COPY --from=build /out /out\nFROM build\nFROM ${BASE}\n")
    out = offline_from(dockerfile, lambda image: image == "local:1", "agentrl/base:bookworm")
    assert out.splitlines() == ["ARG BASE=python:3.12", "FROM agentrl/base:bookworm AS build", "RUN make",
                                "FROM --platform=linux/amd64 local:1", "COPY --from=build /out /out", "FROM build",
                                "FROM ${BASE}"]


def test_dockerfile_workdir(tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM a\nWORKDIR /x\nFROM b\nWORKDIR /srv\nWORKDIR app\n")
    assert dockerfile_workdir(tmp_path / "Dockerfile") == "/srv/app"


# ---- in Docker ----

@pytest.mark.docker
def test_gold_solutions_pass_every_task():
    """`agentrl envs check`: the separate verifier with its artifact, the shared one, reward.json."""
    assert agentrl.check("harbor/tasks-v0", tasks=str(TASKS)) == []


@pytest.mark.docker
def test_the_tests_grade_what_the_agent_did():
    reward, done, info = play("agentrl/count-errors", call("bash", command="echo 47 > answer.txt"),
                              call("submit", summary="counted"))
    assert (reward, done) == (0.0, True) and info["reward_components"] == {"reward": 0.0}
    reward, _, _ = play("agentrl/count-errors", call("bash", command="grep -c ERROR server.log > answer.txt"),
                        call("submit", summary="counted"))
    assert reward == 1.0
    # reward.json: its `reward`, and its other numbers as components; [verifier.env] reached test.sh
    broken = call("edit", path="stats.py", old="return ordered[middle]\n", new="return None\n")
    fixed = call("edit", path="stats.py", old="sum(xs) // len(xs)", new="sum(xs) / len(xs)")
    reward, _, info = play("agentrl/fix-mean", fixed, broken, call("submit", summary="fixed"))
    assert reward == 0.5 and info["reward_components"] == {"reward": 0.5, "mean": 1.0, "median": 0.0}


@pytest.mark.docker
def test_the_tests_see_the_final_state_not_the_live_box():
    """A process the agent leaves behind, which would delete its answer once the tests arrive, takes no part: the
    tests run in a fresh container of the final state. And a separate verifier sees the artifacts only."""
    saboteur = ("(while [ ! -e /tests/test.sh ]; do sleep 0.05; done; rm -f /app/answer.txt) >/dev/null 2>&1 & "
                "grep -c ERROR server.log > answer.txt")
    reward, _, _ = play("agentrl/count-errors", call("bash", command=saboteur), call("submit", summary="counted"))
    assert reward == 1.0
    reward, _, info = play("agentrl/hello-world", call("bash", command="echo 'Hello, world!' > elsewhere.txt"),
                           call("submit", summary="wrote it"))
    assert reward == 0.0 and "artifacts not found in the agent's box: /app/hello.txt" in info["detail"]


@pytest.mark.docker
def test_a_rollout_ends_graded_by_test_sh_at_max_turns():
    reward, done, info = play("agentrl/count-errors", "no tool call here", "nor here", max_turns=2, max_invalid=5)
    assert (reward, done) == (0.0, True) and info["reason"] == "graded at max_turns=2"
    assert info["detail"].startswith("test.sh:")


@pytest.mark.docker
@pytest.mark.slow
def test_grpo_steps_over_harbor_tasks(tiny_model_dir, tmp_path):
    """Two GRPO steps of the tiny model on the three tasks: every episode played and graded, none an error."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.policy.hf import HFPolicy
    from agentrl.policy.protocol import SamplingParams
    from agentrl.rollout.engine import RolloutConfig
    from agentrl.trainers.methods import grpo
    from agentrl.trainers.rewards import RewardConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    make_env = lambda split="train", **kw: agentrl.make("harbor/tasks-v0", tasks=str(TASKS), max_turns=2,  # noqa: E731
                                                        max_invalid=5, split=split, **kw)
    tasks = list(make_env().tasks)
    cfg = grpo.GRPOConfig(steps=2, tasks_per_step=3, group_size=2, lr=1e-3,
                          reward=RewardConfig(terms={"env": 1.0, "random": 0.5}),
                          rollout=RolloutConfig(max_total_tokens=2048, step_timeout=300,
                                                sampling=SamplingParams(max_tokens=16)))
    metrics = grpo.train(cfg, model, tokenizer, HFPolicy(model, tokenizer), make_env, tasks, tmp_path)
    assert [m["episodes"] for m in metrics] == [6, 6] and all(m["error_frac"] == 0.0 for m in metrics)
    assert all(m["groups_trained"] == 3 and "loss" in m for m in metrics)


@pytest.mark.slow
def test_harbor_itself_finds_the_tasks_valid():
    """`harbor lint` (Harbor 0.26, Python 3.12, in a virtualenv of its own): no finding but the advice to run the
    verifier separately, which two tasks decline on purpose (the shared path is tested too)."""
    harbor = ensure(Venv(python="3.12", requirements=("harbor==0.26.0",))) / "bin" / "harbor"
    folders = [str(TASKS / name.split("/")[1]) for name in NAMES]
    result = subprocess.run([str(harbor), "lint", "--ignore", "shared-verifier", *folders], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    flagged = subprocess.run([str(harbor), "lint", *folders], capture_output=True, text=True, timeout=300)
    assert flagged.returncode != 0 and flagged.stdout.count("[shared-verifier]") == 2
