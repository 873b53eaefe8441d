"""The side of the verifiers 0.4 adapter that runs inside verifiers' own virtualenv (`verifiers_v1.py` starts it):
one command per process, its JSON arguments as argv[2], its result as one JSON line on stdout.

    tasks {"taskset": {...}}                                   -> [{"key", "prompt": [messages], "data"}, ...]
    run   {"taskset": {...}, "index", "base_url", "model"}     -> {"reward", "rewards", "stop", "errors"}
    score {"taskset": {...}, "index", "completion": [messages]} -> {"reward", "rewards"}

`run` is verifiers' own rollout: `load_environment` with the `null` harness (its plain chat loop, run by `uv` as
verifiers runs it) in a local subprocess runtime, its model calls sent to `base_url` (a gateway session), scored by
the task's own rewards. `score` is the same scoring of a given completion, without a model: the trace is built as
verifiers' interception server builds it (each assistant message a committed turn).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import verifiers.v1 as vf
from verifiers.v1 import graph
from verifiers.v1.trace import AgentInfo, TraceTask
from verifiers.v1.utils.loaders import load_environment, resolve_env_config

MESSAGES = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}


def environment(taskset: dict[str, Any]) -> Any:
    """The taskset's env, its agent the `null` harness in a local subprocess."""
    return load_environment(resolve_env_config({
        "taskset": taskset, "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}}))


def prompt_of(task: Any) -> list[dict[str, str]]:
    """The task's first messages, as verifiers' harness sends them: its system prompt, then its prompt."""
    data = task.data
    system = getattr(data, "system_prompt", None)
    prompt = data.prompt if isinstance(data.prompt, list) else [{"role": "user", "content": data.prompt}]
    messages = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in prompt]
    return ([{"role": "system", "content": system}] if system else []) + messages


def tasks(args: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"key": task.key, "prompt": prompt_of(task), "data": task.data.model_dump(mode="json")}
            for task in environment(args["taskset"]).taskset.load()]


def nth_task(env: Any, index: int) -> Any:
    for i, task in enumerate(env.taskset.load()):
        if i == index:
            return task
    raise IndexError(f"the taskset has no task {index}")


async def run(args: dict[str, Any]) -> dict[str, Any]:
    env = environment(args["taskset"])
    task = nth_task(env, args["index"])
    client = vf.EvalClientConfig(base_url=args["base_url"], api_key_var="AGENTRL_API_KEY")
    async with env.serving():
        episode = await env.run_episode(task, vf.ModelContext(model=args["model"], client=client))
    [trace] = episode.traces
    return {"reward": trace.reward, "rewards": {k: v.score for k, v in trace.rewards.items()},
            "stop": trace.stop_condition, "errors": [e.message for e in trace.errors]}


async def score(args: dict[str, Any]) -> dict[str, Any]:
    task = nth_task(environment(args["taskset"]), args["index"])
    trace = vf.Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                     agent=AgentInfo(config=vf.AgentConfig(model="given")))
    history = [MESSAGES[m["role"]](content=m["content"]) for m in prompt_of(task)]
    for m in args["completion"]:
        message = MESSAGES[m["role"]](content=m["content"])
        if m["role"] == "assistant":
            graph.prepare_turn(trace, history).commit(vf.Response(id="given", created=int(time.time()), model="given",
                                                                  message=message, finish_reason="stop"))
        history.append(message)
    await task.score(trace)
    return {"reward": trace.reward, "rewards": {k: v.score for k, v in trace.rewards.items()}}


def main() -> None:
    command, args = sys.argv[1], json.loads(sys.argv[2])
    result = tasks(args) if command == "tasks" else asyncio.run({"run": run, "score": score}[command](args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
