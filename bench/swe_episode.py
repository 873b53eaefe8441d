"""Wall time of a scripted 20-step SWE episode (look around, edit, run code, submit and grade) through the
warm sandbox pool, against starting a fresh container for every step, in the same run.

Warm: `swe/generated-v0` as the trainer uses it: reset leases a running container from the pool and sets
the repository up, then 19 tool calls and submit, which grades with the hidden tests. Fresh: the same 20
commands, each in a new container of the same image (create, start, copy the repository, run, remove), as
an agent harness without a pool would run them. Ratio = warm / fresh (lower is better).

    python bench/swe_episode.py [--quick]

Needs Docker and generated tasks (`make setup-swe`). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import agentrl
from agentrl.envs.swe.env import REPO
from agentrl.tools.sandbox.docker_runtime import DockerRuntime
from agentrl.types import ToolCall
from results import record  # bench/results.py: the last line, kept in bench/results/


def script(task) -> list[tuple[str, dict]]:
    """Twenty tool calls: explore, read, run code, apply the fix, check, submit."""
    source = task.data["patch"].split(" b/", 1)[1].split("\n", 1)[0]
    module = source.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    look = [("bash", {"command": "ls"}), ("bash", {"command": "git status --short"}),
            ("bash", {"command": f"grep -n 'def ' {source} | head -20"}), ("view", {"path": source})]
    probe = [("bash", {"command": f"python3 -c 'import {module}; print({module}.__name__)'"}),
             ("view", {"path": source, "start": 40, "end": 80})] * 6
    fix = f"cat > /tmp/fix.patch <<'EOF'\n{task.data['patch']}EOF\ngit apply /tmp/fix.patch"
    check = [("bash", {"command": fix}), ("bash", {"command": "git diff --stat"}),
             ("bash", {"command": f"python3 -c 'import {module}'"})]
    return look + probe + check + [("submit", {"summary": "fixed"})]


def as_command(name: str, args: dict, task) -> str:
    """The shell command a step amounts to, for the fresh-container baseline."""
    if name == "bash":
        return args["command"]
    if name == "view":
        return f"cat -n {shlex.quote(args['path'])} | sed -n '{args.get('start', 1)},{args.get('end', 200)}p'"
    return task.data["test_cmd"]  # submit: grading runs the tests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one episode of each kind (under a minute)")
    a = parser.parse_args()
    repeats = 1 if a.quick else 3
    env = agentrl.make("swe/generated-v0", split="train", n_tasks=1)
    task = env.tasks[0]
    steps = script(task)
    assert len(steps) == 20
    env.reset(seed=0, options={"task": task})  # warms the pool: its containers exist before timing
    warm, fresh = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        env.reset(seed=0, options={"task": task})
        for name, args in steps:
            _, reward, terminated, _, _ = env.step(env.parser.format_call(ToolCall(name, args)))
        warm.append(time.perf_counter() - start)
        assert terminated and reward == 1.0, "the scripted episode must resolve its task"

        start = time.perf_counter()
        for name, args in steps:
            sandbox = DockerRuntime(env.limits, image=task.data["image"])
            sandbox.start()
            sandbox.run(argv=["bash", "-c", f"cp -a {task.data['repo_dir']}/. {REPO} && cd {REPO} && "
                              + as_command(name, args, task)])
            sandbox.close()
        fresh.append(time.perf_counter() - start)
    env.close()
    w, f = statistics.median(warm), statistics.median(fresh)
    print(f"20-step episode: warm pool {w:.2f} s, fresh container per step {f:.2f} s", file=sys.stderr)
    record(__file__, {"ratio": round(w / f, 3), "warm_s": round(w, 2), "fresh_s": round(f, 2),
                      "warm_per_step_ms": round(1000 * w / 20, 1), "fresh_per_step_ms": round(1000 * f / 20, 1),
                      "episodes": repeats, "task": task.id})


if __name__ == "__main__":
    main()
