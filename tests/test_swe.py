"""The SWE env: bug injection by hand, the SWE-bench loader, and (Docker) generated tasks graded as
SWE-bench grades them: the gold patch resolves, the untouched repository does not, deleting the failing
tests does not help, and hanging or flooding commands are contained."""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

import pytest

import agentrl
from agentrl.envs.swe.generate import INSTANCES, candidates, file_diff, generate_repo
from agentrl.envs.swe.env import TEST_CONFIG, gradable, patch_paths, single_hunk_edit, split_patch
from agentrl.envs.swe.instances import InconsistentOutput, load_jsonl, parse_pytest_summary, to_task
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


SUMMARY = ("t.py::test_a PASSED\n===== short test summary info =====\nPASSED t.py::test_a\n"
           "FAILED t.py::test_b[x-y] - AssertionError: assert 1 == 2\nERROR t.py::test_c\nSKIPPED [1] t.py:3: no gdbm\n"
           "===== 1 failed, 1 passed, 1 skipped, 1 error in 0.12s =====\n")


def test_pytest_summary_parsing():
    assert parse_pytest_summary(SUMMARY) == {"t.py::test_a": "PASSED", "t.py::test_b[x-y]": "FAILED",
                                             "t.py::test_c": "ERROR"}
    assert parse_pytest_summary("PASSED t.py::test_a\n") == {}  # no final line: the run did not finish
    assert parse_pytest_summary(SUMMARY.replace("0.12s =====", "65.43s (0:01:05) =====")) != {}


@pytest.mark.parametrize("forged, message", [
    # what code under test prints at exit (atexit), after pytest's own report
    (SUMMARY + "PASSED t.py::test_b[x-y]\n", "output after the final counts line"),
    (SUMMARY + "===== short test summary info =====\nPASSED t.py::test_b[x-y]\n== 2 passed in 0.1s ==\n",
     "output after the final counts line"),
    # printed into the summary (a patched reporter): a test with two statuses, or counts that disagree
    (SUMMARY.replace("ERROR t.py::test_c", "PASSED t.py::test_b[x-y]\nERROR t.py::test_c"), "reported FAILED and PASSED"),
    (SUMMARY.replace("PASSED t.py::test_a\n", "PASSED t.py::test_a\nPASSED t.py::test_d\n"), "2 passed status lines"),
    ("===== short test summary info =====\n" + SUMMARY, "two short test summaries"),
])
def test_test_output_that_contradicts_itself_is_refused(forged, message):
    with pytest.raises(InconsistentOutput, match=re.escape(message)):
        parse_pytest_summary(forged)


def test_the_agent_patch_is_graded_without_tests_or_test_settings():
    patch = (file_diff("src/m.py", "a = 1\n", "a = 2\n") + file_diff("tests/test_m.py", "x\n", "y\n")
             + file_diff("conftest.py", None, "import pytest\n") + file_diff("pkg/sub/pytest.ini", None, "[pytest]\n")
             + file_diff("evil.pth", None, "import os\n"))
    kept, left_out = split_patch(patch, lambda p: p == "tests/test_m.py" or Path(p).name in TEST_CONFIG
                                 or p.endswith(".pth"))
    assert kept == file_diff("src/m.py", "a = 1\n", "a = 2\n")
    assert left_out == ["conftest.py", "evil.pth", "pkg/sub/pytest.ini", "tests/test_m.py"]
    renamed = "diff --git a/src/m.py b/tests/test_m.py\nsimilarity index 100%\nrename from src/m.py\nrename to tests/test_m.py\n"
    assert patch_paths(renamed) == {"src/m.py", "tests/test_m.py"}


BASE = {"pkg/__init__.py", "pkg/m.py", "tests/test_m.py", "setup.py", "README.md", "pytest.ini"}


@pytest.mark.parametrize("path, graded", [
    # what forged a reward of 1.0 by a name the old list did not hold: a config, a plugin's entry point, a module
    # that shadows pytest or the standard library
    (".pytest.ini", False), ("pytest.toml", False), ("pkg-1.0.dist-info/entry_points.txt", False),
    ("pytest/__init__.py", False), ("argparse.py", False), ("tests/argparse.py", False),
    # the names refused before
    ("conftest.py", False), ("pkg/conftest.py", False), ("sub/sitecustomize.py", False), ("x.pth", False),
    ("pytest.ini", False), ("tests/test_m.py", False),
    # the code under test: its files, new modules and subpackages inside its packages
    ("pkg/m.py", True), ("pkg/new.py", True), ("pkg/sub/__init__.py", True), ("pkg/sub/x.py", True),
    ("setup.py", True), ("README.md", True),
])
def test_only_the_code_under_test_is_graded(path, graded):
    assert gradable(path, BASE, {"tests/test_m.py"}) == graded


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


# ------------------------------------------------------------------------------- forged grading (#33)
def forge(task) -> str:
    """Python that, at exit, prints a PASSED line for every graded test: what fooled a last-line-wins grader."""
    ids = task.data["FAIL_TO_PASS"] + task.data["PASS_TO_PASS"]
    return f"import atexit\natexit.register(lambda: print(''.join('PASSED ' + t + chr(10) for t in {ids!r})))\n"


def assert_not_resolved(env, reason: str = ""):
    _, reward, terminated, _, info = call(env, "submit", summary="done")
    assert terminated and reward == 0.0 and info["reward_components"]["fail_to_pass"] < 1.0, info
    assert reason in info["detail"], info["detail"]
    return info


@pytest.mark.docker
def test_interpreter_hooks_planted_in_home_do_not_reach_the_grader(env):
    task = env.tasks[0]
    env.reset(seed=0, options={"task": task})
    plant = (f"import site, pathlib\nfor d in (site.getusersitepackages(), '..', '.'):\n"
             f"    pathlib.Path(d).mkdir(parents=True, exist_ok=True)\n"
             f"    for name in ('usercustomize.py', 'sitecustomize.py'):\n"
             f"        (pathlib.Path(d) / name).write_text({forge(task)!r})\n")
    env.sandbox.write("plant.py", plant)
    assert call(env, "bash", command="python3 ../plant.py && python3 -c 'pass'")[0][0].content.startswith("PASSED")
    info = assert_not_resolved(env, "not graded (tests, test settings, or new files outside the packages): "
                                    "sitecustomize.py, usercustomize.py")
    assert "+++ b/sitecustomize.py" in info["detail"]  # the recorded diff still shows what the agent did


@pytest.mark.docker
def test_start_up_files_under_new_names_are_not_graded(env):
    """Ways that forged a reward of 1.0 past a grader that left files out by name: a pytest config, a plugin's entry
    point and modules that shadow pytest or the standard library, each read when the tests start."""
    task = env.tasks[0]
    env.reset(seed=0, options={"task": task})
    report = forge(task) + "raise SystemExit(0)\n"  # a pytest that only prints every graded test as passed
    planted = {"pytest/__init__.py": "", "pytest/__main__.py": report, "argparse.py": report,
               ".pytest.ini": "[pytest]\naddopts = -p forged\n", "pytest.toml": "[pytest]\naddopts = ['-p', 'forged']\n",
               "forged-1.0.dist-info/entry_points.txt": "[pytest11]\nforged = forged\n", "forged.py": report}
    for path, content in planted.items():
        env.sandbox.write(f"repo/{path}", content)
    info = assert_not_resolved(env, "not graded (tests, test settings, or new files outside the packages): ")
    assert all(path in info["detail"].split("\n--- diff\n")[0] for path in planted)


@pytest.mark.docker
def test_results_printed_by_the_code_under_test_are_not_trusted(env):
    task = env.tasks[0]
    env.reset(seed=0, options={"task": task})
    module = single_hunk_edit(task.data["patch"])["path"]
    env.sandbox.write("forge.py", forge(task))
    call(env, "bash", command=f"cat ../forge.py >> {module}")
    assert_not_resolved(env, "the test output is not to be trusted: output after the final counts line")


@pytest.mark.docker
def test_committed_test_edits_are_not_graded(env):
    """Tests that exist in the repository (as in SWE-bench's images): the agent weakens and commits them; the
    grader restores them from the base commit recorded at setup, not from the agent's HEAD."""
    from agentrl.envs.swe.env import spec_of
    from agentrl.envs.swe.generate import CACHE, file_diff
    from agentrl.envs.swe.repos import fetch
    from agentrl.types import Task

    task = env.tasks[0]
    test_file = task.data["FAIL_TO_PASS"][0].split("::")[0]
    original = (fetch(spec_of(task.data["repo"]), CACHE) / test_file).read_text()
    visible = Task(task.id, {**task.data, "hidden_tests": [],
                             "test_patch": file_diff(test_file, original, "# graded\n" + original)}, task.split)
    env.reset(seed=0, options={"task": visible})
    call(env, "bash", command=f"sed -i 's/assert /assert True or /' {test_file} && git add -A && "
                              "git -c user.name=a -c user.email=a@b commit -qm 'fix tests'")
    assert "nothing to commit" in call(env, "bash", command="git status")[0][0].content
    assert_not_resolved(env, f"not graded (tests, test settings, or new files outside the packages): {test_file}")
    env.reset(seed=0, options={"task": visible})  # and the gold fix still resolves this form of the task
    for action in env.gold_actions(visible):
        _, reward, *_ = env.step(action)
    assert reward == 1.0


@pytest.mark.docker
@pytest.mark.parametrize("sabotage", ["mkdir ../.test.patch ../.agent.patch ../.test_output", "rm -rf .git",
                                      "git replace -f HEAD $(git commit-tree HEAD^{tree} -m x)",
                                      "echo '* diff=x' > .gitattributes && git config diff.x.textconv false"])
def test_sabotaging_the_grader_is_a_failure_not_an_error(env, sabotage):
    env.reset(seed=0, options={"task": env.tasks[0]})
    call(env, "bash", command=sabotage)
    _, reward, terminated, _, info = call(env, "submit", summary="done")
    assert terminated and reward == 0.0 and "outcome" in info["reward_components"], info


# --- grading, without Docker: SWEEnv.score with local sandboxes -----------------------------------------------
# The test command prints `report.txt`, which the agent writes: each case's test output is written by hand, and the
# grader reaches it through the agent's diff, the test patch and the fresh copy, as in a real episode.

def pytest_report(*status_lines: str, final: str) -> str:
    return "===== short test summary info =====\n" + "".join(f"{s}\n" for s in status_lines) + f"===== {final} =====\n"


ALL_PASS = pytest_report("PASSED t.py::a", "PASSED t.py::b", "PASSED t.py::c", final="3 passed in 0.01s")


@pytest.mark.parametrize("report, fail_to_pass, pass_to_pass, components, detail", [
    # FAIL_TO_PASS 1 of 2, PASS_TO_PASS 1 of 1: not resolved
    (pytest_report("PASSED t.py::a", "FAILED t.py::b - assert 0", "PASSED t.py::c", final="1 failed, 2 passed in 0.01s"),
     ["t.py::a", "t.py::b"], ["t.py::c"], {"outcome": 0.0, "fail_to_pass": 0.5, "pass_to_pass": 1.0},
     "FAIL_TO_PASS 0.50, PASS_TO_PASS 1.00"),
    (ALL_PASS, ["t.py::a", "t.py::b"], ["t.py::c"], {"outcome": 1.0, "fail_to_pass": 1.0, "pass_to_pass": 1.0},
     "FAIL_TO_PASS 1.00, PASS_TO_PASS 1.00"),
    # a broken PASS_TO_PASS test (1 of 4 pass: 0.25) sinks the fix; an empty PASS_TO_PASS counts as all passed
    (pytest_report("PASSED t.py::a", "ERROR t.py::b", "XFAIL t.py::c", "XPASS t.py::d", "FAILED t.py::e",
                   final="1 failed, 1 passed, 1 xfailed, 1 xpassed, 1 error in 0.01s"),
     ["t.py::a"], ["t.py::a", "t.py::b", "t.py::c", "t.py::e"],
     {"outcome": 0.0, "fail_to_pass": 1.0, "pass_to_pass": 0.25}, "FAIL_TO_PASS 1.00, PASS_TO_PASS 0.25"),
    (ALL_PASS, ["t.py::c"], [], {"outcome": 1.0, "fail_to_pass": 1.0, "pass_to_pass": 1.0},
     "FAIL_TO_PASS 1.00, PASS_TO_PASS 1.00"),
    # output that contradicts itself (3 PASSED lines, "2 passed") passes nothing, even an instance with no tests
    (ALL_PASS.replace("3 passed", "2 passed"), ["t.py::a"], ["t.py::c"],
     {"outcome": 0.0, "fail_to_pass": 0.0, "pass_to_pass": 0.0},
     "FAIL_TO_PASS 0.00, PASS_TO_PASS 0.00; the test output is not to be trusted: 3 passed status lines, but the "
     "final line says 2 (2 passed)"),
    (ALL_PASS.replace("3 passed", "2 passed"), [], [], {"outcome": 0.0, "fail_to_pass": 1.0, "pass_to_pass": 1.0},
     "FAIL_TO_PASS 1.00, PASS_TO_PASS 1.00; the test output is not to be trusted"),
    # no final counts line: the run never finished
    ("PASSED t.py::a\n", ["t.py::a"], [], {"outcome": 0.0, "fail_to_pass": 0.0, "pass_to_pass": 1.0},
     "FAIL_TO_PASS 0.00, PASS_TO_PASS 1.00; the tests did not run: "),
])
def test_the_grade_is_the_fraction_of_each_test_list_that_passed(tmp_path, monkeypatch, report, fail_to_pass,
                                                                  pass_to_pass, components, detail):
    score = grade_locally(tmp_path, monkeypatch, writes_report(report), fail_to_pass, pass_to_pass)
    assert score.components == components
    assert score.detail.startswith(detail)
    assert "+++ b/report.txt" in score.detail.split("\n--- diff\n", 1)[1]


def test_the_tests_get_300_seconds_whatever_a_tool_calls_timeout(tmp_path, monkeypatch):
    score = grade_locally(tmp_path, monkeypatch, writes_report(ALL_PASS), ["t.py::a"], [],
                          test_cmd="sleep 2 && cat report.txt", timeout=1.0)
    assert score.components == {"outcome": 1.0, "fail_to_pass": 1.0, "pass_to_pass": 1.0}


def writes_report(report: str):
    """The agent's work: what the test command (`cat report.txt`) will print."""
    return lambda sandbox: sandbox.write("repo/report.txt", report)


def grade_locally(tmp_path, monkeypatch, work, fail_to_pass, pass_to_pass, upstream_report="not run\n",
                  test_cmd="cat report.txt", timeout=30.0):
    """SWEEnv.score, in local sandboxes, of an episode whose agent did `work(sandbox)` in a repository holding
    `upstream_report` as report.txt; the test patch adds t.py."""
    import subprocess

    from agentrl.envs.swe.env import SWEEnv
    from agentrl.tools.sandbox import LocalRuntime
    from agentrl.tools.sandbox.pool import SandboxPool

    upstream = tmp_path / "upstream"  # the instance's repository: `repo_dir`, copied by `setup` as from an image
    upstream.mkdir()
    (upstream / "report.txt").write_text(upstream_report)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(upstream)]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "base"]):
        subprocess.run(git + args, check=True)
    task = to_task({"instance_id": "local-1", "problem_statement": "-", "image": "none", "repo_dir": str(upstream),
                    "FAIL_TO_PASS": fail_to_pass, "PASS_TO_PASS": pass_to_pass, "test_cmd": test_cmd,
                    "test_patch": file_diff("t.py", None, "def test_a():\n    pass\n")})
    env = SWEEnv(instances=str(tmp_path), timeout=timeout)
    pool = SandboxPool(lambda: LocalRuntime(env.limits), size=2, warm=False)
    monkeypatch.setattr(env, "_pool", lambda: pool)  # local sandboxes in place of the instance's Docker image
    try:
        env.on_reset(task)
        work(env.sandbox)
        return env.score(task, "", ())
    finally:
        env.close()
        pool.close()


def test_the_agents_edits_to_tests_and_test_settings_are_not_graded(tmp_path, monkeypatch):
    def work(sandbox):
        # the test patch makes the test command print report.txt as the tests leave it; the agent's own t.py and
        # conftest.py would print a passing one
        sandbox.write("repo/t.py", "print('PASSED t.py::b')\n")
        sandbox.write("repo/x/conftest.py", "import sys\n")
        # without prefixes the diff names x/conftest.py, which the filter read as no path, and which `git apply -p1`
        # created as a root conftest.py
        assert sandbox.run(argv=["git", "-C", "repo", "config", "diff.noprefix", "true"]).ok

    failing = ALL_PASS.replace("PASSED t.py::b", "FAILED t.py::b").replace("3 passed", "1 failed, 2 passed")
    score = grade_locally(tmp_path, monkeypatch, work, ["t.py::b"], [], upstream_report=failing)
    assert score.components == {"outcome": 0.0, "fail_to_pass": 0.0, "pass_to_pass": 1.0}
    assert score.detail.startswith("FAIL_TO_PASS 0.00, PASS_TO_PASS 1.00; not graded (tests, test settings, or new files "
                                   "outside the packages): t.py, x/conftest.py\n--- diff\n")
