"""verifiers environments as agentrl envs: `verifiers/arith-tools-v0`, `verifiers/guess-v0`, or any installed
verifiers environment with `environment="NAME"` (what `vf.load_environment(NAME, **env_args)` loads), or any
env class or factory with `environment="module:callable"` (called with `env_args`).

verifiers 0.1.x envs (`SingleTurnEnv`, `MultiTurnEnv`, `ToolEnv`, `StatefulToolEnv` and subclasses) run their
own loop against an OpenAI client. Here agentrl's rollout engine samples the tokens, and this adapter plays
the env's side of that loop with the env's own hooks, in the order `MultiTurnEnv.rollout` calls them:
`init_state` and `setup_state` at reset, then per turn the assistant message becomes a trajectory step
(`add_trajectory_step`), the env's stop conditions are checked (`is_completed`), and `get_prompt_messages`
(which calls `env_response`) gives the next messages. At the end the env's rubric scores the rollout; its
reward is the episode's and its metrics are the reward components. Tool calls are parsed from the model's
Hermes `<tool_call>` blocks into OpenAI's format (ids as agentrl's own tool envs number them), as vLLM's
hermes tool parser would; a malformed block gets a corrective message and is not shown to the env. An error
the env raises (`vf.Error`) ends the episode as status `error` with its message (as in verifiers' own loop).

Not adapted: verifiers 0.4's `v1` task/harness API (its rollouts run a harness program that `uv` installs),
completion-format (`message_type="completion"`) envs and rubrics with group-level reward functions (both refused
with a message).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import threading
from functools import lru_cache
from typing import Any, Sequence

from agentrl.env.api import TextEnv, with_ids
from agentrl.tools.parsers import HermesParser
from agentrl.types import Message, Task, ToolCall


class VerifiersEnv(TextEnv):
    """A verifiers environment played turn by turn; tasks are the rows of its dataset (train) or its eval
    dataset (any other split)."""

    def __init__(self, environment: str, env_args: dict[str, Any] | None = None, split: str = "train",
                 n_tasks: int | None = None, max_turns: int = 10):
        super().__init__(split=split, max_turns=max_turns)
        self.inner = load(environment, json.dumps(env_args or {}, sort_keys=True))
        if self.inner.message_type != "chat":
            raise ValueError(f"{environment!r} is a {self.inner.message_type!r}-format env; only chat envs are adapted")
        if _group_funcs(self.inner.rubric):
            raise ValueError(f"{environment!r} has group-level reward functions "
                             f"({', '.join(f.__name__ for f in _group_funcs(self.inner.rubric))}): agentrl scores "
                             "each episode on its own; give the env a rubric of per-rollout functions")
        self.n_tasks = n_tasks
        args = ",".join(f"{k}={v}" for k, v in sorted((env_args or {}).items()))
        name = environment.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
        self.task_prefix = f"verifiers/{name}" + (f"[{args}]" if args else "")
        self.parser = HermesParser()
        self.state: dict[str, Any] | None = None

    def load_tasks(self, split: str) -> Sequence[Task]:
        """The env's dataset rows (its eval dataset for any split but train), the first `n_tasks` of them."""
        rows = self.inner.get_dataset() if split == "train" else self.inner.get_eval_dataset()
        rows = rows.select(range(min(self.n_tasks, len(rows)))) if self.n_tasks else rows
        return [Task(f"{self.task_prefix}/{split}/{row['example_id']}", dict(row)) for row in rows]

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return list((self.state or {}).get("oai_tools") or getattr(self.inner, "oai_tools", None) or [])

    def on_reset(self, task: Task) -> None:
        self.close()
        state = self._run(self.inner.init_state(dict(task.data), client=None, model="agentrl"))
        self.state = self._run(self.inner.setup_state(state))
        self._messages = list(self._run(self.inner.get_prompt_messages(self.state)))

    def first_messages(self, task: Task) -> Sequence[Message]:
        """The env's prompt (system prompt, few-shot examples and the question, as its dataset formats them)."""
        return tuple(_message(m) for m in self._messages)

    def assistant_message(self, action: str) -> Message:
        completion = self._completion(action)
        return Message("assistant", action) if isinstance(completion, str) else _message(completion)

    def act(self, action: str):
        completion = self._completion(action)
        if isinstance(completion, str):  # a malformed call: the model is told, the env never sees the turn
            return [Message("user", f"Invalid action: {completion}")], 0.0, False, {}
        state = self.state
        step = {"prompt": self._messages, "completion": [completion], "response": None, "tokens": None,
                "reward": None, "advantage": None, "is_truncated": False,
                "trajectory_id": state["trajectory_id"], "extras": {}}
        self._run(self.inner.add_trajectory_step(state, step))
        done = self._run(self.inner.is_completed(state))
        new: list = []
        if not done:
            before = len(self._messages) + 1
            self._messages = list(self._run(self.inner.get_prompt_messages(state)))
            new = self._messages[before:]
            done = state.get("final_env_response") is not None and self._run(self.inner.is_completed(state))
        if not done:
            return [_message(m) for m in new], 0.0, False, {"tool_calls": len(completion.get("tool_calls", ()))}
        self._run(self.inner.render_completion(state))
        self._run(self.inner.rubric.score_rollout(state))
        metrics = {k: float(v) for k, v in (state.get("metrics") or {}).items()}
        info = {"reward_components": metrics, "reason": f"stop: {state.get('stop_condition')}"}
        return [], float(state["reward"]), True, info

    def gold_actions(self, task: Task) -> list[str]:
        """The row's `gold` turns (a list of assistant texts), where the dataset has them."""
        gold = (task.data.get("info") or {}).get("gold")
        if not gold:
            raise NotImplementedError(f"task {task.id} has no gold turns: verifiers datasets hold answers, not "
                                      "solutions; add info['gold'] = [assistant texts] to the rows to validate")
        return list(gold)

    def close(self) -> None:
        if self.state is not None and not self.state.get("is_completed"):
            self._run(self.inner._cleanup(self.state))  # the env's @vf.cleanup handlers (sandboxes, ...)
        self.state = None

    @staticmethod
    def _run(coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, _verifiers_loop()).result()

    def _completion(self, action: str) -> dict[str, Any] | str:
        """The turn as verifiers sees it: an OpenAI assistant message whose Hermes `<tool_call>` blocks are tool
        calls (envs without tools get the text as it is), or the parser's message when a call is malformed."""
        text = {"role": "assistant", "content": action}
        if not self.tool_schemas:
            return text
        parsed = self.parser.parse(action)
        if parsed.error and "<tool_call>" in action:
            return parsed.error
        if not parsed.tool_calls:
            return text
        return {"role": "assistant", "content": parsed.content,
                "tool_calls": [_openai_call(c) for c in with_ids(parsed.tool_calls)]}

@lru_cache(maxsize=None)
def _verifiers_loop() -> asyncio.AbstractEventLoop:
    """One event loop in a daemon thread for every verifiers env of the process, as verifiers runs its rollouts
    (concurrently, on one loop); env methods block on it from any thread, the engine's loop included."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="agentrl-verifiers", daemon=True).start()
    return loop


@lru_cache(maxsize=None)
def load(environment: str, env_args_json: str):
    """The verifiers env `environment` (an installed env's name, or "module:callable") made once per process
    with `env_args` (its dataset is built once)."""
    try:
        import datasets
        import verifiers as vf
    except ImportError as e:
        raise ImportError("the verifiers adapter needs `pip install 'verifiers>=0.1.9,<0.2'`") from e
    datasets.disable_progress_bars()  # verifiers formats its datasets with `map`: one bar per split and env
    if ":" in environment:  # "module:callable", e.g. one of verifiers' own env classes
        module, name = environment.split(":")
        return getattr(importlib.import_module(module), name)(**json.loads(env_args_json))
    return vf.load_environment(environment, **json.loads(env_args_json))


def _group_funcs(rubric) -> list:
    """The rubric's group-level reward functions, through `RubricGroup`s."""
    if hasattr(rubric, "rubrics"):
        return [f for r in rubric.rubrics for f in _group_funcs(r)]
    return rubric._get_group_reward_funcs()


def _message(m: dict[str, Any]) -> Message:
    calls = tuple(ToolCall(c["function"]["name"], json.loads(c["function"]["arguments"]), c.get("id", ""))
                  for c in m.get("tool_calls") or ())
    return Message(m["role"], m.get("content") or "", calls, m.get("tool_call_id"))


def _openai_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
