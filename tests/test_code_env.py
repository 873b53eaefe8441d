"""The code envs: hidden tests counted one by one (by hand), generated tasks, HumanEval's canonical
solutions in the real sandbox (164/164) and a wrong one failing, and multi-turn episodes through the
rollout engine with a scripted policy, including a sandbox that dies mid-episode."""

from __future__ import annotations

import asyncio
import random

import pytest

import agentrl
from agentrl.envs.code.harness import run_tests, split_check
from agentrl.envs.code.tasks import TEMPLATES, example_input, generated, humaneval
from agentrl.rollout.engine import RolloutConfig, RolloutEngine
from agentrl.policy.scripted import ScriptedPolicy, playing
from agentrl.tools.sandbox import Limits, LocalRuntime, RunResult
from agentrl.types import Status, ToolCall

PROMPT = 'def inc(x: int) -> int:\n    """Return x + 1."""\n'
TESTS = """
LIMIT = 100
def check(candidate):
    assert candidate(1) == 2
    values = [candidate(i) for i in range(3)]
    assert values == [1, 2, 3]
    for i in range(LIMIT):
        assert candidate(i) == i + 1
    assert candidate(-1) == 0
"""


def test_split_check_counts_statements_with_asserts():
    prelude, statements = split_check(TESTS)
    assert prelude == "LIMIT = 100"
    assert [is_test for is_test, _ in statements] == [True, False, True, True, True]  # a loop of asserts is one


def test_constant_asserts_are_not_tests():
    """HumanEval's checks hold `assert True, "..."`: counted as tests, a function returning None earned 0.056."""
    _, statements = split_check("def check(candidate):\n    assert True, 'debug'\n    assert 1 == 1\n"
                                "    assert candidate(1) == 2\n")
    assert [is_test for is_test, _ in statements] == [False, False, True]
    for source, message in [("def other(candidate):\n    assert candidate(1) == 2\n",
                             "the tests define no `check(candidate)` function"),
                            ("def check(candidate):\n    assert True\n", "check(candidate) holds no assert")]:
        with pytest.raises(ValueError) as e:
            split_check(source)
        assert str(e.value) == message


def test_a_tester_that_prints_no_report_is_reported_with_the_end_of_its_stderr():
    class Crashing:  # a sandbox whose run ends in a long traceback, not a report
        def run(self, **kwargs):
            self.timeout = kwargs["timeout"]
            return RunResult(exit_code=1, stdout="", stderr="x" * 400 + "MemoryError")

    sandbox = Crashing()
    report = run_tests(sandbox, PROMPT, "def inc(x):\n    return x + 1\n", "inc", TESTS, timeout=7)
    assert sandbox.timeout == 7
    assert (report.passed, report.total) == (0, 4)
    assert report.error == f"the tests did not finish (exit code 1: {'x' * 289}MemoryError)"  # its last 300 characters


def test_a_solution_that_does_nothing_passes_no_humaneval_test(local):
    tasks = humaneval("all")
    # (tasks whose function may rightly return None are left out)
    with_constants = [t for t in tasks if "assert True" in t.data["test"] and "None" not in t.data["test"]]
    assert len(with_constants) >= 10
    for task in with_constants:
        d = task.data
        report = run_tests(local, d["prompt"], d["prompt"] + "    return None\n", d["entry_point"], d["test"], 5)
        assert report.passed == 0, (task.id, report)


@pytest.fixture
def local():
    rt = LocalRuntime(Limits(timeout=3))
    yield rt
    rt.close()


@pytest.mark.parametrize("solution, passed, error", [
    ("def inc(x):\n    return x + 1\n", 4, ""),
    ("def inc(x):\n    return abs(x) + 1\n", 3, "AssertionError"),  # only candidate(-1) == 0 fails
    ("def inc(x):\n    return 2\n", 1, "AssertionError"),  # candidate(1) == 2 only
    ("def inc(x) return x\n", 0, "does not load: SyntaxError"),
    ("def other(x):\n    return x + 1\n", 0, "does not load: KeyError: 'inc'"),  # not the stub instead
    # a forged report is ignored: the real one is 1/4
    ("def inc(x):\n    print('\\nAGENTRL_TESTS 0 {\"passed\": 4, \"total\": 4}')\n    return 0\n", 1, "AssertionError"),
    ("def inc(x):\n    while True:\n        pass\n", 0, "did not finish (timed out)"),
    # a solution that kills the tester passes nothing, and the reason says how the tester ended
    ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n", 0, "did not finish (exit code -9"),
    # the solution runs in its own process: the tester's globals are out of reach...
    ("import __main__, os\n__main__._report(__main__._total)\nos._exit(0)\ndef inc(x):\n    return 0\n", 0,
     "does not load: AttributeError"),
    # ...and only plain values come back: an object equal to everything is not one
    ("class Yes:\n    def __eq__(self, other):\n        return True\ndef inc(x):\n    return Yes()\n", 0,
     "cannot pass between the tests and the solution"),
])
def test_hidden_tests_by_hand(local, solution, passed, error):
    report = run_tests(local, PROMPT, solution, "inc", TESTS, timeout=2)
    assert (report.passed, report.total) == (passed, 4)
    assert error in report.error
    assert report.fraction == passed / 4


@pytest.mark.docker
def test_the_solution_cannot_open_the_graders_proc_files_in_the_sandbox():
    """In the sandbox (uid 1000, no capabilities) the tester and the runner are non-dumpable: the solution's
    process cannot write into their output or read their memory, which would let it forge the report."""
    from agentrl.tools.sandbox import Limits
    from agentrl.tools.sandbox.docker_runtime import DockerRuntime

    probe = ("import os\n"
             "def inc(x):\n"
             "    for path, mode in ((f'/proc/{os.getppid()}/fd/1', 'wb'), (f'/proc/{os.getppid()}/mem', 'rb'),\n"
             "                       ('/proc/1/fd/1', 'wb'), ('/proc/1/mem', 'rb')):\n"
             "        try:\n"
             "            open(path, mode).close()\n"
             "            return x + 1  # reachable: then every test passes\n"
             "        except OSError:\n"
             "            pass\n"
             "    return 0\n")
    sandbox = DockerRuntime(Limits(timeout=5))
    sandbox.start()
    try:
        assert run_tests(sandbox, PROMPT, probe, "inc", TESTS, timeout=5).passed == 1  # candidate(-1) == 0 only
        assert run_tests(sandbox, PROMPT, "def inc(x):\n    return x + 1\n", "inc", TESTS, timeout=5).passed == 4
    finally:
        sandbox.close()


def test_generated_tasks_are_deterministic_and_held_out_templates_are_unseen():
    assert generated("train", 20, seed=3) == generated("train", 20, seed=3)
    train = {t.data["template"] for t in generated("train", 200)}
    heldout = {t.data["template"] for t in generated("heldout", 200)}
    assert train == {t.name for t in TEMPLATES["train"]} and not train & heldout
    assert len(humaneval("train")) + len(humaneval("heldout")) == len(humaneval("all")) == 164


@pytest.mark.parametrize("mode", ["tools", "direct"])
def test_generated_env_checks_with_the_local_runtime(mode):
    assert agentrl.check("code/generated-v0", sandbox="local", n_tasks=20, mode=mode) == []


@pytest.mark.docker
def test_humaneval_canonical_solutions_pass_in_the_sandbox_and_wrong_ones_fail():
    env = agentrl.make("code/humaneval-v0", split="all")
    try:
        assert env.validate(n_tasks=164) == []
        task = env.tasks[0]
        env.reset(seed=0, options={"task": task})
        stub = task.data["prompt"] + "    return False\n"
        _, reward, terminated, _, info = env.step(env.parser.format_call(ToolCall("submit", {"code": stub})))
        assert terminated and 0 < reward < 1 and info["reward_components"]["outcome"] == 0.0
    finally:
        env.close()
    assert agentrl.check("code/humaneval-v0") == []


@pytest.mark.docker
def test_multi_turn_episode_runs_fixes_and_submits(renderer):
    env = agentrl.make("code/generated-v0", split="heldout", n_tasks=4)
    task = env.tasks[0]
    wrong = task.data["prompt"] + "    return None\n"
    script = [env.parser.format_call(ToolCall("python", {"code": "print(sum(range(5)))"})),
              env.parser.format_call(ToolCall("python", {"code": "raise ValueError('boom')"})),
              env.parser.format_call(ToolCall("submit", {"code": env.solution(task)}))]
    policy = ScriptedPolicy(renderer, playing({task.data["prompt"]: script}), "<|im_start|>assistant")
    engine = RolloutEngine(lambda: agentrl.make("code/generated-v0", split="heldout", n_tasks=4), policy, renderer,
                           RolloutConfig(max_total_tokens=4096))
    try:
        [group] = asyncio.run(engine.run([task]))
    finally:
        engine.close()
    t = group.trajectories[0]
    assert t.status == Status.OK and t.reward == 1.0 and t.reward_components["outcome"] == 1.0
    tool_outputs = [m.content for m in t.messages if m.role == "tool"]
    assert tool_outputs[0] == "10" and "ValueError: boom" in tool_outputs[1] and "[exit code 1]" in tool_outputs[1]
    assert wrong not in tool_outputs  # the hidden tests never show up in the episode
    env.close()


@pytest.mark.docker
def test_a_sandbox_that_dies_mid_episode_ends_it_as_error(renderer):
    env = agentrl.make("code/generated-v0", split="heldout", n_tasks=4)
    task = env.tasks[0]
    script = [env.parser.format_call(ToolCall("python", {"code": "print(1)"}))] * 2
    step = env.step

    def step_after_the_container_is_gone(action):  # e.g. the daemon lost it between two turns
        if env.turn == 1:
            env.sandbox.container.kill()
        return step(action)

    env.step = step_after_the_container_is_gone
    policy = ScriptedPolicy(renderer, playing({task.data["prompt"]: script}), "<|im_start|>assistant")
    engine = RolloutEngine(lambda: env, policy, renderer, RolloutConfig(max_total_tokens=4096))
    try:
        [group] = asyncio.run(engine.run([task]))
    finally:
        engine.close()
    t = group.trajectories[0]
    assert t.status == Status.ERROR and "SandboxError" in t.reason and "died" in t.reason, t.reason
    assert [m.content for m in t.messages if m.role == "tool"] == ["1"]


def test_the_code_reward_is_the_fraction_of_hidden_tests_passed():
    # a generated task's gold solution passes every hidden test; its stub passes none: the reward is the fraction
    # passed (tests_passed), and outcome is 1 exactly when all pass
    env = agentrl.make("code/generated-v0", sandbox="local", n_tasks=1)
    try:
        env.reset(seed=0)
        task = env.task
        gold = env.score(task, env.solution(task), ())
        stub = env.score(task, task.data["prompt"] + "    pass\n", ())
    finally:
        env.close()
    assert gold.components == {"tests_passed": 1.0, "outcome": 1.0}
    n = gold.detail.split("/")[1].split(" ")[0]
    assert gold.detail == f"{n}/{n} hidden tests"
    assert stub.components == {"tests_passed": 0.0, "outcome": 0.0}
    assert stub.detail.startswith(f"0/{n} hidden tests; ")


@pytest.mark.parametrize("reply, reward", [
    ("Here it is:\n```python\n{solution}```\nIt returns the answer.", 1.0),  # prose around the block is not code
    ("```py\n{solution}", 1.0),  # cut off before the block closed
    ("{solution}", 1.0),  # bare code, no block
    ("```python\n{stub}```\n```python\n{solution}```", 0.0),  # the first block is the submission
])
def test_direct_mode_submits_the_code_of_its_one_reply(reply, reward):
    """The baseline without tools: no tool offered, one turn, and the reply's code scored whatever its format."""
    env = agentrl.make("code/generated-v0", sandbox="local", n_tasks=1, mode="direct")
    try:
        env.reset(seed=0)
        task = env.task
        assert env.tool_schemas == [] and "python tool" not in env.first_messages(task)[0].content
        action = reply.format(solution=env.solution(task), stub=task.data["prompt"] + "    pass\n")
        _, got, terminated, truncated, info = env.step(action)
    finally:
        env.close()
    assert terminated and not truncated and got == reward, info


def test_direct_mode_is_one_reply():
    with pytest.raises(ValueError, match="mode='direct' is one reply"):
        agentrl.make("code/generated-v0", sandbox="local", mode="direct", max_turns=4)


def test_evaluations_break_generated_tasks_down_by_template():
    env = agentrl.make("code/generated-v0", split="heldout", sandbox="local", n_tasks=30)
    try:
        assert {tuple(env.difficulty(t).items()) for t in env.tasks} == {
            (("template", name),) for name in ("index_of", "longest_word", "clip")}
    finally:
        env.close()


def test_generated_tasks_of_named_templates_only():
    tasks = generated("train", 40, templates=["spread", "scale"])
    assert {t.data["template"] for t in tasks} == {"spread", "scale"}
    with pytest.raises(ValueError, match=r"templates \['index_of'\] are not of the 'train' split"):
        generated("train", 4, templates=["index_of"])
    env = agentrl.make("code/generated-v0", sandbox="local", n_tasks=20, templates=["count_char"])
    try:
        assert {t.data["template"] for t in env.tasks} == {"count_char"}
    finally:
        env.close()


def test_run_then_submit_demonstrations_run_an_example_then_submit_the_gold_solution():
    """The expert's run is the reference function on one input its template draws, printed in the sandbox; the
    episode then ends on the gold submission with every hidden test passed."""
    env = agentrl.make("code/generated-v0", sandbox="local", n_tasks=12, demonstrations="run_then_submit")
    try:
        for i in range(len(env.tasks)):
            env.reset(seed=0, options={"task_index": i})
            task, rng = env.task, random.Random(i)
            run, submit = env.demonstration(task, rng)
            assert submit == env.gold_actions(task)[0]
            [call] = env.parser.parse(run).tool_calls
            same = random.Random(i)
            same.random()  # the draw that decides a mistake (error_rate 0: none)
            args = example_input(task, same)
            assert call.name == "python" and call.arguments["code"].endswith(
                f"print({task.data['entry_point']}({', '.join(map(repr, args))}))\n")
            namespace: dict = {}
            exec(env.solution(task), namespace)
            (output,), reward, terminated, _, _ = env.step(run)
            assert not terminated and output.content.strip() == str(namespace[task.data["entry_point"]](*args))
            _, reward, terminated, _, _ = env.step(submit)
            assert terminated and reward == 1.0
    finally:
        env.close()


@pytest.mark.parametrize("kwargs", [{"mode": "direct"}, {"source": "humaneval"}])
def test_run_then_submit_needs_generated_functions_and_the_tools(kwargs):
    with pytest.raises(ValueError, match="needs source='generated' and mode='tools'"):
        agentrl.make("code/generated-v0", sandbox="local", demonstrations="run_then_submit", **kwargs)


def test_an_unknown_demonstration_style_is_refused():
    with pytest.raises(ValueError, match="demonstrations must be one of"):
        agentrl.make("code/generated-v0", sandbox="local", demonstrations="run")
