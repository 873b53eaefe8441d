"""`agentrl envs attack ID`: the project's adversarial policies against any env's grader and reset, for env authors.

    findings = attack(lambda: agentrl.make("my/env-v0"))      # every Finding.held: nothing got through

Each attack plays real episodes through the env's own `step`, with outputs a policy under RL pressure finds:

- **forged reports**: final answers and answer-tool calls that claim success without doing the task ("All tests
  passed", a printed test summary, a score in JSON). None may earn the env's maximum reward or an outcome of 1.
- **failures turned into errors**: hostile outputs (empty, huge, control characters, broken tool-call syntax, unknown
  tools, the env's own tools with hostile arguments). `step` must answer each with an observation and a finite
  reward: an exception makes the episode `error`, which leaves the baselines and escapes the failure's reward.
- **state left for the next episode**: an episode that calls every tool with arguments that write, kill and
  wander off (files in the workspace and `/tmp`, paths and URLs outside the task), then a reset to the same task:
  its first messages and its gold solution's reward must be those of a fresh env.

`tests/test_attack.py` runs it on the shipped envs and on a deliberately weak one, whose hole it reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from agentrl.env.api import TextEnv
from agentrl.types import Task, ToolCall

CLAIMS = ("All tests passed.", "PASSED: 10 of 10 tests", "\nAGENTRL_TESTS 1 {}\n", '{"passed": true, "score": 1.0}',
          "The task is complete. reward = 1.0", "Correct! The answer has been verified.")
HOSTILE_OUTPUTS = ("", " ", "\x00\x1b[2J\r", "🙂" * 5000, "x" * 200_000, "<tool_call>{</tool_call>",
                   '<tool_call>{"name": "no_such_tool", "arguments": {}}</tool_call>', "<answer>", "</answer><answer>",
                   "Action: search[", "<search></search><search>", "<think>" * 1000)
HOSTILE_ARGUMENTS = ("echo leak > /tmp/agentrl_leak; echo leak > leak.txt; kill -9 -1",
                     "import os; open('leak.txt', 'w').write('x'); open('/tmp/agentrl_leak', 'w').write('x')",
                     "../../../../etc/passwd", "/proc/self/environ", "http://127.0.0.1:1/", "file:///etc/passwd",
                     "\x00", "a" * 5000)


@dataclass(frozen=True)
class Finding:
    """One attack's result: whether the env held, and what got through when it did not."""

    attack: str
    held: bool
    detail: str


def _answer_calls(env: TextEnv, claim: str) -> list[str]:
    """`claim` as every way this env takes a final answer: the common answer formats, and its answer tool."""
    texts = [f"<answer>{claim}</answer>", f"Final Answer: {claim}", claim]
    parser, answer_tool = getattr(env, "parser", None), getattr(env, "answer_tool", None)
    schema = next((s["function"] for s in env.tool_schemas if s["function"]["name"] == answer_tool), None)
    if schema is not None and hasattr(parser, "format_call"):
        argument = next(iter(schema.get("parameters", {}).get("properties", {})), "answer")
        texts.append(parser.format_call(ToolCall(answer_tool, {argument: claim})))
    return texts


def _hostile_calls(env: TextEnv) -> list[str]:
    """The env's own tools, each called with every hostile argument in its first string parameter."""
    parser = getattr(env, "parser", None)
    if not hasattr(parser, "format_call"):
        return []
    calls = []
    for schema in env.tool_schemas:
        function = schema["function"]
        params = function.get("parameters", {}).get("properties", {})
        name = next((p for p, spec in params.items() if spec.get("type", "string") == "string"), None)
        if name is not None and function["name"] != getattr(env, "answer_tool", None):
            calls += [parser.format_call(ToolCall(function["name"], {name: value})) for value in HOSTILE_ARGUMENTS]
    return calls


def _episode(env: TextEnv, task: Task, actions: list[str]) -> tuple[float, dict[str, Any], list[str]]:
    """Plays `actions` on `task` until the episode ends: (total reward, last info, problems)."""
    env.reset(seed=0, options={"task": task})
    total, info, problems = 0.0, {}, []
    for action in actions:
        try:
            obs, reward, terminated, truncated, info = env.step(action)
        except Exception as e:  # noqa: BLE001 -- the finding itself
            return total, info, [f"{action[:60]!r} raised {type(e).__name__}: {e}"]
        if not math.isfinite(reward) or not env.observation_space.contains(obs):
            problems.append(f"{action[:60]!r} gave reward {reward} or a malformed observation")
        total += reward
        if terminated or truncated:
            break
    return total, info, problems


def forged_reports(env: TextEnv, tasks: list[Task]) -> Finding:
    """No claim of success, given as a final answer in any form, earns the maximum reward or an outcome of 1."""
    won = []
    for task in tasks:
        for claim in CLAIMS:
            for text in _answer_calls(env, claim):
                total, info, _ = _episode(env, task, [text])
                outcome = info.get("reward_components", {}).get("outcome", 0.0)
                if total >= env.max_reward - 1e-9 or outcome >= 1.0:
                    won.append(f"task {task.id}: {text[:80]!r} scored {total} (outcome {outcome})")
    return Finding("forged reports", not won, "; ".join(won[:3]) or f"{len(CLAIMS)} claims in every answer form")


def errors_from_failures(env: TextEnv, tasks: list[Task]) -> Finding:
    """Every hostile output gets an observation and a finite reward, never an exception."""
    raised, calls = [], _hostile_calls(env)
    for task in tasks[:1]:
        for action in (*HOSTILE_OUTPUTS, *calls):
            raised += _episode(env, task, [action])[2]
    return Finding("failures turned into errors", not raised, "; ".join(raised[:3]) or
                   f"{len(HOSTILE_OUTPUTS)} outputs and {len(calls)} hostile tool calls answered")


def state_across_reset(env: TextEnv, tasks: list[Task]) -> Finding:
    """After an episode of hostile tool calls, a reset to the same task gives what it gave before: the same first
    messages (when two clean resets agree on them), and the gold solution the same reward."""
    leaked = []
    for task in tasks:
        first = env.reset(seed=0, options={"task": task})[0]
        # first messages that differ between two clean resets (an episode's own URL) are not compared
        stable = env.reset(seed=0, options={"task": task})[0] == first
        gold = _episode(env, task, env.gold_actions(task))[0]
        _episode(env, task, _hostile_calls(env) or list(HOSTILE_OUTPUTS))
        if stable and env.reset(seed=0, options={"task": task})[0] != first:
            leaked.append(f"task {task.id}: its first messages changed after a hostile episode")
        again = _episode(env, task, env.gold_actions(task))[0]
        if not math.isclose(again, gold):
            leaked.append(f"task {task.id}: the gold solution got {again} after a hostile episode, {gold} before")
    return Finding("state left for the next episode", not leaked, "; ".join(leaked[:3]) or
                   f"{len(tasks)} tasks replayed after hostile episodes")


def attack(make_env: Callable[[], TextEnv], n_tasks: int = 2) -> list[Finding]:
    """Every attack against the env that `make_env` makes, on its first `n_tasks` tasks."""
    env = make_env()
    try:
        tasks = list(env.tasks)[:n_tasks]
        return [forged_reports(env, tasks), errors_from_failures(env, tasks), state_across_reset(env, tasks)]
    finally:
        env.close()
