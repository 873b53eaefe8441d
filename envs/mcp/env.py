"""`mcp/tools-v0`: train on your MCP tools without writing an env: a task file and a list of servers.

    agentrl envs check mcp/tools-v0 --kwargs '{"tasks": "tasks.jsonl",
        "servers": [{"name": "calc", "command": ["python", "examples/mcp/calculator_server.py"]}]}'

The task file is JSON Lines, one task per line:

    {"id": "t1", "split": "train", "question": "What is 6 * 7?", "answer": "42",
     "solution": [{"name": "calculator", "arguments": {"expression": "6 * 7"}}], "reasoning": "6 * 7 = 42"}

`split` defaults to "train"; `solution` (the gold tool calls, one per turn) and `reasoning` (the text of the gold
final turn before its answer) are what `validate()` and SFT warm starts play; `mistakes` (a list of
`{"reasoning", "answer"}`: plausible wrong answers without the tools) are what an imperfect expert plays instead,
with probability `[sft] error_rate`; `difficulty` (a dict) feeds the evaluation's breakdowns. The reward is
`outcome`: 1 when the final answer equals `answer` after stripping, folding case and collapsing whitespace, else 0.
Servers are `agentrl.tools.mcp.McpServer`s (or their fields as tables); `tools` are `@tool` functions offered beside
them. With `parser = "react"`, a tool whose one parameter is a string takes it as plain text
(`Action: calculator[2 + 3]`).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agentrl.env.api import Score, ToolEnv
from agentrl.tools import PARSERS, ParsedAction, ToolSet
from agentrl.tools.mcp import McpServer, McpTools
from agentrl.types import Message, Task, ToolCall

SYSTEM_PROMPT = ("Answer the question. Call the tools you are given whenever they help, one call per turn, then "
                 "give the final answer alone: {example}\n{fmt}")


def load_tasks(path: str | Path, split: str) -> tuple[Task, ...]:
    """The tasks of `split` in the JSON Lines file at `path` (errors name the file and line)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"task file {path} does not exist (mcp/tools-v0 needs tasks=PATH of a JSON Lines "
                                f"file; see agentrl.envs.mcp.env)")
    tasks, splits = [], set()
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record.get("question"), str) or not isinstance(record.get("answer"), str):
                raise ValueError("needs a string 'question' and a string 'answer'")
            calls = [ToolCall(c["name"], dict(c["arguments"])) for c in record.get("solution", [])]
            if not all(isinstance(m["answer"], str) for m in record.get("mistakes", [])):
                raise ValueError("each of 'mistakes' needs a string 'answer'")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}:{n}: not a task: {e}") from None
        splits.add(record.get("split", "train"))
        if record.get("split", "train") == split:
            tasks.append(Task(id=str(record.get("id", f"{path.stem}-{n}")), split=split, data={
                **record, "solution": calls}))
    if not tasks:
        raise ValueError(f"{path} has no tasks of split {split!r} (its splits: {sorted(splits)})")
    return tuple(tasks)


def normalized(answer: str) -> str:
    """`answer` as the scorer compares it: stripped, whitespace runs as one space, case folded."""
    return re.sub(r"\s+", " ", answer.strip()).casefold()


def plain_arguments(schemas: Sequence[dict[str, Any]]) -> dict[str, str]:
    """Tool name -> its one parameter, for tools whose only parameter is a string: ReAct reads `calculator[2 + 3]`."""
    plain = {}
    for schema in schemas:
        properties = schema["function"]["parameters"].get("properties", {})
        if len(properties) == 1 and next(iter(properties.values())).get("type") == "string":
            plain[schema["function"]["name"]] = next(iter(properties))
    return plain


class McpToolsEnv(ToolEnv):
    """Questions from `tasks` (a JSON Lines file), answered with the tools of `servers` (and `tools`)."""

    def __init__(self, tasks: str, servers: Sequence[McpServer | Mapping[str, Any]], split: str = "train",
                 tools: Sequence = (), parser: str = "hermes", system_prompt: str = SYSTEM_PROMPT,
                 max_turns: int = 8, max_invalid: int = 3, max_calls_per_turn: int | None = 1):
        if parser not in PARSERS:
            raise ValueError(f"parser must be one of {sorted(PARSERS)}, got {parser!r}")
        if not servers:
            raise ValueError("mcp/tools-v0 needs servers=[{name, command or url, ...}, ...]")
        self.task_file, self.system_prompt = tasks, system_prompt
        toolset = ToolSet([*tools, *McpTools(servers)], max_calls_per_turn)
        parser_obj = PARSERS[parser](plain_arguments(toolset.schemas)) if parser == "react" else PARSERS[parser]()
        super().__init__(toolset, parser_obj, split=split, max_turns=max_turns, max_invalid=max_invalid)

    def load_tasks(self, split: str) -> Sequence[Task]:
        return load_tasks(self.task_file, split)

    def first_messages(self, task: Task) -> Sequence[Message]:
        prompt = self.system_prompt.format(example=self.parser.format_answer("..."), fmt=self.parser.instructions)
        return Message("system", prompt), Message("user", task.data["question"])

    def score(self, task: Task, answer: str, transcript: Sequence[ParsedAction]) -> Score:
        gold = task.data["answer"]
        return Score({"outcome": float(normalized(answer) == normalized(gold))}, detail=f"gold={gold}")

    def difficulty(self, task: Task) -> dict[str, Any]:
        return dict(task.data.get("difficulty") or {})

    def gold_actions(self, task: Task) -> list[str]:
        final = self._final_turn(task.data.get("reasoning", ""), task.data["answer"])
        return [*(self.parser.format_call(call) for call in task.data["solution"]), final]

    def demonstration(self, task: Task, rng: random.Random, error_rate: float = 0.0) -> list[str]:
        """The gold solution; with probability `error_rate`, one of the task's `mistakes` instead (where it has any):
        a wrong final answer given without the tools, for warm starts from an imperfect expert."""
        mistakes = task.data.get("mistakes") or []
        if not mistakes or rng.random() >= error_rate:
            return self.gold_actions(task)
        mistake = rng.choice(mistakes)
        return [self._final_turn(mistake.get("reasoning", ""), mistake["answer"])]

    def _final_turn(self, reasoning: str, answer: str) -> str:
        return "\n".join(filter(None, [reasoning, self.parser.format_answer(answer)]))
