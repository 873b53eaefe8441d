"""The SWE env: bug injection by hand, the SWE-bench loader, and (Docker) generated tasks graded as
SWE-bench grades them: the gold patch resolves, the untouched repository does not, deleting the failing
tests does not help, and hanging or flooding commands are contained."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

import agentrl
from agentrl.envs.swe.generate import INSTANCES, candidates, file_diff, generate_repo
from agentrl.envs.swe.instances import load_jsonl, parse_pytest_summary, to_task
from agentrl.envs.swe.mutate import mutate, sites
from agentrl.envs.swe.repos import REPOS
from agentrl.types import ToolCall

SOURCE = '''def f(xs, k=2):
    """Doc."""
    total = 0
    for x in xs:
        if x < k:
            total += max(x, 1)
        else:
            total -= 3
    return total
'''


def changed_lines(before: str, after: str) -> list[tuple[str, str]]:
    return [(a, b) for a, b in zip(before.splitlines(), after.splitlines()) if a != b]


def test_mutations_by_hand():
    assert sites(SOURCE) == {"flip_comparison": 1, "change_constant": 4, "swap_arguments": 1, "remove_line": 2,
                             "drop_branch": 1}
    assert changed_lines(SOURCE, mutate(SOURCE, "flip_comparison", 0)) == [("        if x < k:", "        if x >= k:")]
    assert changed_lines(SOURCE, mutate(SOURCE, "change_constant", 3)) == [
        ("            total -= 3", "            total -= 4")]
    assert changed_lines(SOURCE, mutate(SOURCE, "swap_arguments", 0)) == [
        ("            total += max(x, 1)", "            total += max(1, x)")]
    assert "    total = 0\n" not in mutate(SOURCE, "remove_line", 0)  # the docstring is never a site
    assert "else" not in mutate(SOURCE, "drop_branch", 0) and "total -= 3" not in mutate(SOURCE, "drop_branch", 0)
    with pytest.raises(IndexError, match="1 drop_branch sites"):
        mutate(SOURCE, "drop_branch", 1)


def test_file_diffs_apply_as_git_patches(tmp_path):
    import subprocess

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "m.py").write_text(SOURCE)
    buggy = mutate(SOURCE, "flip_comparison", 0)
    (tmp_path / "fix.patch").write_text(file_diff("m.py", SOURCE, buggy) + file_diff("t/new.py", None, "x = 1"))
    subprocess.run(["git", "apply", "fix.patch"], cwd=tmp_path, check=True)
    assert (tmp_path / "m.py").read_text() == buggy and (tmp_path / "t/new.py").read_text() == "x = 1"


def test_loader_reads_swe_bench_instances(tmp_path):
    row = {"instance_id": "astropy__astropy-12907", "repo": "astropy/astropy", "base_commit": "d16bfe05a7",
           "problem_statement": "Modeling's separability_matrix ...", "patch": "diff ...", "test_patch": "diff ...",
           "FAIL_TO_PASS": json.dumps(["astropy/modeling/tests/test_separable.py::test_separable[compound_model6]"]),
           "PASS_TO_PASS": json.dumps(["astropy/modeling/tests/test_separable.py::test_coord_matrix"]),
           "image": "my/astropy:12907"}
    (tmp_path / "i.jsonl").write_text(json.dumps(row) + "\n")
    [task] = load_jsonl(tmp_path / "i.jsonl")
    assert task.data["FAIL_TO_PASS"] == ["astropy/modeling/tests/test_separable.py::test_separable[compound_model6]"]
    assert task.data["repo_dir"] == "/testbed"
    assert task.data["test_cmd"].endswith("-q astropy/modeling/tests/test_separable.py")
    with pytest.raises(ValueError, match="missing image"):
        to_task({k: v for k, v in row.items() if k != "image"})


def test_folder_format(tmp_path):
    from agentrl.envs.swe.instances import load

    task_dir = tmp_path / "tasks" / "mylib-1"
    task_dir.mkdir(parents=True)
    (task_dir / "instance.json").write_text(json.dumps({
        "FAIL_TO_PASS": ["tests/test_a.py::test_x"], "PASS_TO_PASS": [], "image": "me/mylib:1", "repo_dir": "/repo",
        "problem_statement": "overridden below", "split": "train"}))
    (task_dir / "problem_statement.md").write_text("`x()` returns 2, not 1.")
    (task_dir / "patch.diff").write_text("diff --git a/a.py b/a.py\n")
    [task] = load(tmp_path / "tasks", split="train")
    assert task.id == "mylib-1" and task.data["problem_statement"] == "`x()` returns 2, not 1."
    assert task.data["patch"].startswith("diff --git") and task.data["repo_dir"] == "/repo"
    assert load(tmp_path / "tasks", split="heldout") == []


def test_pytest_summary_parsing():
    out = ("PASSED t.py::test_a\nFAILED t.py::test_b[x-y] - AssertionError: assert 1 == 2\nERROR t.py::test_c\n"
           "SKIPPED [1] t.py:3: no gdbm\n== 1 failed, 1 passed ==\n")
    assert parse_pytest_summary(out) == {"t.py::test_a": "PASSED", "t.py::test_b[x-y]": "FAILED",
                                         "t.py::test_c": "ERROR"}


def test_candidate_order_is_deterministic_and_alternates_kinds(tmp_path):
    import random

    from agentrl.envs.swe.repos import RepoSpec

    (tmp_path / "m.py").write_text(SOURCE)
    spec = RepoSpec("m", "m==0", ("m.py",), ())
    order = candidates(tmp_path, spec, random.Random("0-m"))
    assert order == candidates(tmp_path, spec, random.Random("0-m")) and len(order) == 9
    assert [kind for _, kind, _ in order[:5]] == ["flip_comparison", "change_constant", "swap_arguments",
                                                   "remove_line", "drop_branch"]


# --- Docker: the generated dataset and its grading ---------------------------------------------------------


@pytest.fixture(scope="module")
def generated():
    """The dataset `agentrl swe generate` built (make setup-swe); a clear failure if it is missing."""
    assert INSTANCES.exists(), f"no generated SWE tasks at {INSTANCES}: run `agentrl swe generate`"
    return [json.loads(line) for line in INSTANCES.read_text().splitlines()]


@pytest.mark.docker
def test_generated_dataset_has_50_tasks_over_3_repositories_with_held_out_splits(generated):
    by_repo = collections.Counter(i["repo"] for i in generated)
    splits = collections.Counter(i["split"] for i in generated)
    assert len(generated) >= 50 and len(by_repo) >= 3, by_repo
    assert splits["train"] and splits["heldout_repo"] and splits["heldout_kind"], splits
    assert {i["repo"] for i in generated if i["split"] == "heldout_repo"}.isdisjoint(
        {i["repo"] for i in generated if i["split"] == "train"})
    assert all(i["FAIL_TO_PASS"] and i["PASS_TO_PASS"] for i in generated)


@pytest.mark.docker
@pytest.mark.slow
def test_generation_is_deterministic(tmp_path):
    from agentrl.tools.sandbox.docker_runtime import client

    spec = REPOS[0]
    runs = [generate_repo(spec, INSTANCES.parents[1], 3, 0, lambda kind: "train", client(), lambda _: None)
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 3


@pytest.fixture
def env(generated):
    e = agentrl.make("swe/generated-v0", split="train", n_tasks=6)
    yield e
    e.close()


def call(env, name, **arguments):
    return env.step(env.parser.format_call(ToolCall(name, arguments)))


@pytest.mark.docker
def test_gold_patch_resolves_and_the_untouched_repository_does_not(env):
    assert env.validate(n_tasks=6) == []
    for task in list(env.tasks)[:3]:
        env.reset(seed=0, options={"task": task})
        _, reward, terminated, _, info = call(env, "submit", summary="no change")
        assert terminated and reward == 0.0 and info["reward_components"]["fail_to_pass"] < 1.0


@pytest.mark.docker
def test_the_hidden_tests_are_absent_and_deleting_or_faking_tests_does_not_help(env):
    task = env.tasks[0]
    env.reset(seed=0, options={"task": task})
    test_file = task.data["FAIL_TO_PASS"][0].split("::")[0]
    hidden = call(env, "bash", command=f"ls {test_file}")[0][0].content
    # nowhere else either: the image holds no clean copy of the repository to diff against
    found = call(env, "bash", command=f"find / -name {Path(test_file).name} -not -path '/proc/*' 2>/dev/null; true")
    assert Path(test_file).name not in found[0][0].content
    history = call(env, "bash", command="git log --oneline")[0][0].content
    assert "No such file" in hidden and history.endswith(" base") and len(history.splitlines()) == 1
    # the agent writes a trivially passing file where the test was, and deletes the rest
    call(env, "create", path=test_file, content="def test_nothing():\n    pass\n")
    _, reward, terminated, _, info = call(env, "submit", summary="tests fixed")
    assert terminated and reward == 0.0 and info["reward_components"]["fail_to_pass"] < 1.0


@pytest.mark.docker
def test_hanging_and_flooding_commands_are_contained(env):
    env.reset(seed=0, options={"task": env.tasks[0]})
    flood = call(env, "bash", command="yes spam | head -c 50000000")[0][0].content
    assert "bytes of output truncated" in flood and len(flood) < 20_000
    hang = call(env, "bash", command="sleep 1000")[0][0].content
    assert "killed: still running after the 30 s timeout" in hang
    assert call(env, "bash", command="echo alive")[0][0].content == "alive"


@pytest.mark.docker
def test_editor_tools_and_corrective_messages(env):
    env.reset(seed=0, options={"task": env.tasks[0]})
    assert call(env, "create", path="notes/a.py", content="x = 1\ny = 1\n")[0][0].content == "created notes/a.py"
    assert "exists" in call(env, "create", path="notes/a.py", content="")[0][0].content
    assert "occurs 2 times" in call(env, "edit", path="notes/a.py", old=" = 1", new=" = 2")[0][0].content
    assert call(env, "edit", path="notes/a.py", old="y = 1", new="y = 3")[0][0].content == "edited notes/a.py"
    assert call(env, "view", path="notes/a.py")[0][0].content == "     1\tx = 1\n     2\ty = 3\n[lines 1-2 of 2]"
    assert "cannot read" in call(env, "view", path="missing.py")[0][0].content
    assert "cannot read" in call(env, "view", path="../../etc/passwd")[0][0].content  # outside the workspace


@pytest.mark.docker
def test_episode_is_graded_when_the_turns_run_out(generated):
    env = agentrl.make("swe/generated-v0", split="train", n_tasks=1, max_turns=2)
    try:
        task = env.tasks[0]
        env.reset(seed=0, options={"task": task})
        apply_fix = env.gold_actions(task)[0]
        call(env, "bash", command="true")
        _, reward, terminated, truncated, info = env.step(apply_fix)  # the last turn: graded, not cut off
        assert terminated and not truncated and reward == 1.0 and "max_turns" in info["reason"]
    finally:
        env.close()
