"""One conformance suite for any agentrl env, ours or adapted: what an env must do to train well here.

    problems = conformance(lambda: agentrl.make("textarena/GuessTheNumber-v0"))   # [] = conforms

1. Gymnasium's API checker (`check_env`, with our unicode text action space).
2. `validate()`: the env's gold solutions (or scripted solver) get the maximum reward.
3. Seeding: the same seed gives the same task and first messages; a task passed in options is played as given.
4. Bad actions (junk text, broken tool-call syntax, an empty turn) give an observation, not an exception.
5. Concurrent episodes: `concurrency` envs in threads each play a gold episode, all at full reward.
6. Cleanup: `close()` twice is fine, and a new env works after others were closed.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from agentrl.env.api import TextEnv
from agentrl.env.registry import check_instance

BAD_ACTIONS = ("", "🙂 \x00 junk {", '<tool_call>{"name": "nope", "arguments": {</tool_call>', "<answer>")


def conformance(make_env: Callable[[], TextEnv], n_tasks: int = 3, concurrency: int = 4) -> list[str]:
    """The problems of the env that `make_env` makes, by the checks above; `[]` when it conforms.

    `make_env` is called twice, then once per concurrent episode (from threads): each call must give a new
    env."""
    problems = check_instance(make_env(), n_tasks)
    env = make_env()
    try:
        a = env.reset(seed=7)[0]
        b = env.reset(seed=7)[0]
        if a != b:
            problems.append("seeding: reset(seed=7) twice gave different first messages")
        task = env.tasks[min(1, len(env.tasks) - 1)]
        _, info = env.reset(seed=0, options={"task": task})
        if info.get("task_id") != task.id:
            problems.append(f"seeding: options['task'] {task.id} was not played (info task_id {info.get('task_id')})")
        for action in BAD_ACTIONS:
            env.reset(seed=0, options={"task": task})
            try:
                obs, reward, terminated, truncated, _ = env.step(action)
            except Exception as e:  # noqa: BLE001 -- the finding itself
                problems.append(f"bad action {action!r} raised {type(e).__name__}: {e}")
                continue
            if not env.observation_space.contains(obs) or not math.isfinite(reward):
                problems.append(f"bad action {action!r}: observation {obs!r} or reward {reward} is malformed")
    finally:
        env.close()
        env.close()  # twice: must be harmless

    def play(i: int) -> list[str]:
        e = make_env()
        try:
            return e.validate(tasks=[e.tasks[i % len(e.tasks)]])  # each thread its own task
        finally:
            e.close()

    with ThreadPoolExecutor(concurrency) as pool:
        for i, found in enumerate(pool.map(play, range(concurrency))):
            problems += [f"concurrent episode {i}: {p}" for p in found]
    return problems

