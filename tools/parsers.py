"""Tool-call parsers: the assistant's text for one turn -> a `ParsedAction`.

Every parser follows one contract:
- `parse` never raises, whatever the text. Malformed text gives `error`, a short corrective message that the env
  shows the model; then `tool_calls` is empty and `answer` is None, so the env never acts on half-parsed text.
- `format_call` / `format_answer` write text that `parse` reads back to the same call / answer (gold solutions,
  SFT data, round-trip tests). They raise ValueError for what the format cannot express.
- `instructions` is one line that an env's system prompt can include to describe the format.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from agentrl.tools.arguments import lone_surrogate
from agentrl.types import ToolCall


@dataclass(frozen=True)
class ParsedAction:
    content: str  # what the model said besides its action (e.g. its reasoning)
    tool_calls: tuple[ToolCall, ...] = ()
    answer: str | None = None  # the final answer, when the model gave one
    error: str | None = None  # a corrective message for the model when the text is malformed


def _load_json_object(text: str, where: str) -> tuple[dict[str, Any] | None, str | None]:
    """(object, None) or (None, message for the model)."""
    text = text.strip()  # so that error positions count from the first character the model sees as JSON
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"Invalid JSON in {where}: {e.msg} at char {e.pos}"
    except RecursionError:
        return None, f"Invalid JSON in {where}: nested too deeply"
    except ValueError as e:  # integers over Python's 4300-digit conversion limit
        return None, f"Invalid JSON in {where}: {str(e).split(':')[0]}"
    if not isinstance(value, dict):
        return None, f"{where} must hold a JSON object, got {_json_type(value)}"
    if half := lone_surrogate(value):
        return None, f"Invalid JSON in {where}: {half} is half of a surrogate pair, not a character"
    return value, None


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array"}
    return "null" if value is None else names.get(type(value), "an object")


def _check_free_of(text: str, tags: tuple[str, ...], what: str) -> None:
    """format_* helpers: a value that contains these tags would not read back unchanged."""
    for tag in tags:
        if tag in text:
            raise ValueError(f"{what} cannot contain {tag}: {text!r}")


class HermesParser:
    """Hermes / Qwen format: JSON in `<tool_call>` blocks, as Qwen2.5's chat template renders them.

    `content` is the text before the first `<tool_call>`, stripped (as vLLM's hermes parser does); with no
    tool call it is the whole text. The answer is the last `<answer>...</answer>` outside the tool calls.
    """

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    template_syntax = True  # its calls are what a chat template renders for a message's `tool_calls`
    instructions = ('To call a tool, write {"name": <tool-name>, "arguments": <args-json-object>} inside '
                    "<tool_call></tool_call> tags; when you know the final answer, write it inside "
                    "<answer></answer> tags.")

    def parse(self, text: str) -> ParsedAction:
        """The turn's `<tool_call>` calls or its `<answer>`; a turn with both is an error."""
        first = text.find(self.OPEN)
        content = (text if first < 0 else text[:first]).strip()
        calls, outside, error = self._parse_calls(text)
        if error is None:
            answer, error = _last_answer(outside)
        if error is not None:
            return ParsedAction(content, error=error)
        if calls and answer is not None:
            return ParsedAction(content, error="Either call a tool or give your <answer>, not both in one turn.")
        return ParsedAction(content, tuple(calls), answer)

    def _parse_calls(self, text: str) -> tuple[list[ToolCall], str, str | None]:
        """The calls, the text outside the call blocks, and an error message."""
        calls, outside, pos = [], [], 0
        while (start := text.find(self.OPEN, pos)) >= 0:
            outside.append(text[pos:start])
            end = text.find(self.CLOSE, start + len(self.OPEN))
            if end < 0:
                return [], "", f"Unclosed {self.OPEN}: end each call with {self.CLOSE}."
            call, error = _call_from_json(text[start + len(self.OPEN) : end])
            if error is not None:
                return [], "", error
            calls.append(call)
            pos = end + len(self.CLOSE)
        outside.append(text[pos:])
        return calls, "".join(outside), None

    def format_call(self, call: ToolCall) -> str:
        """Byte for byte what Qwen2.5's template renders for one call (HF's `tojson` is json.dumps(ensure_ascii=False)).

        Several calls in one message: put a newline between calls, and between the content (if any) and the first.
        """
        body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
        _check_free_of(body, (self.CLOSE,), "a Hermes tool call")
        return f"{self.OPEN}\n{body}\n{self.CLOSE}"

    def format_answer(self, answer: str) -> str:
        """`answer` in `<answer>` tags; ValueError if it holds those tags or `<tool_call>`."""
        _check_free_of(answer, ("<answer>", "</answer>", self.OPEN), "a Hermes answer")
        return f"<answer>{answer}</answer>"


def _call_from_json(body: str) -> tuple[ToolCall | None, str | None]:
    obj, error = _load_json_object(body, "<tool_call>")
    if obj is None:
        return None, error
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None, 'A <tool_call> needs a "name": the tool name as a string.'
    if "arguments" not in obj:
        return None, f'The <tool_call> for {name} needs "arguments": a JSON object (use {{}} for none).'
    if not isinstance(obj["arguments"], dict):
        return None, f'"arguments" of {name} must be a JSON object, got {_json_type(obj["arguments"])}.'
    return ToolCall(name, obj["arguments"]), None


def _last_answer(text: str) -> tuple[str | None, str | None]:
    """The last <answer>...</answer> (stripped), and an error if an <answer> is left open."""
    last_open, last_close = text.rfind("<answer>"), text.rfind("</answer>")
    if last_open > last_close:
        return None, "Unclosed <answer>: end it with </answer>."
    if last_close < 0:
        return None, None
    start = text.rfind("<answer>", 0, last_close)
    if start < 0:
        return None, "Found </answer> without <answer>: write your answer as <answer>...</answer>."
    return text[start + len("<answer>") : last_close].strip(), None


class ReActParser:
    """ReAct format: `Thought: ...` then `Action: tool[args]`, or `Final Answer: ...` (or `Action: finish[...]`).

    `args` is a JSON object, or plain text for tools listed in `default_args` (tool name -> the name of its single
    string parameter), e.g. `ReActParser({"search": "query"})` reads `search[capital of France]`. The Action must
    be the last thing in the turn: the model should stop after `]` and wait for the Observation.
    """

    FINISH = "finish"
    template_syntax = False  # its calls are its own text, which no chat template renders from `tool_calls`
    instructions = ("Write 'Thought: <your reasoning>', then either 'Action: <tool>[<arguments as a JSON object>]' "
                    "and stop, or 'Final Answer: <your answer>' when you are done.")
    _ACTION = re.compile(r"^[ \t]*Action[ \t]*:", re.M)
    _FINAL = re.compile(r"^[ \t]*Final Answer[ \t]*:", re.M)
    _THOUGHT = re.compile(r"\s*Thought[ \t]*:")
    _CALL = re.compile(r"([^\s\[\]]+)[ \t]*\[(.*)\]", re.S)  # name[args]; args run to the last ']'

    def __init__(self, default_args: dict[str, str] | None = None):
        self.default_args = dict(default_args or {})

    def parse(self, text: str) -> ParsedAction:
        """The turn's one Action, or its answer (`Final Answer:` or `finish[...]`).

        `content` is the Thought, without its label.
        """
        actions = list(self._ACTION.finditer(text))
        final = self._FINAL.search(text)
        starts = [m.start() for m in (actions[:1] + [final]) if m is not None]
        head = text[: min(starts)] if starts else text
        thought = self._THOUGHT.match(head)
        content = (head[thought.end() :] if thought else head).strip()
        if len(actions) > 1:
            return ParsedAction(content, error=f"Write one Action per turn; you wrote {len(actions)}.")
        if actions and final:
            return ParsedAction(content, error="Write either an Action or a Final Answer, not both.")
        if final:
            return ParsedAction(content, answer=text[final.end() :].strip())
        if not actions:
            return ParsedAction(content, error="Write 'Action: <tool>[<arguments>]' to use a tool, "
                                               "or 'Final Answer: <answer>' when you are done.")
        return self._parse_action(content, text[actions[0].end() :].strip())

    def _parse_action(self, content: str, body: str) -> ParsedAction:
        match = self._CALL.fullmatch(body)
        if match is None:
            return ParsedAction(content, error="Could not read the Action. Write it as 'Action: <tool>[<arguments>]' "
                                               "and stop after the closing ']'.")
        name, raw = match.group(1), match.group(2).strip()
        if name == self.FINISH:
            return ParsedAction(content, answer=raw)
        if raw.startswith("{"):
            args, error = _load_json_object(raw, f"the arguments of {name}")
            if args is None:
                return ParsedAction(content, error=error)
        elif name in self.default_args:
            args = {self.default_args[name]: raw}
        elif not raw:
            args = {}
        else:
            return ParsedAction(content, error=f'Pass the arguments of {name} as a JSON object, '
                                               f'e.g. Action: {name}[{{"argument": "value"}}].')
        return ParsedAction(content, (ToolCall(name, args),))

    def format_call(self, call: ToolCall) -> str:
        """Plain text for single-string-argument tools in `default_args` where it reads back unchanged, else JSON."""
        if not re.fullmatch(r"[^\s\[\]]+", call.name) or call.name == self.FINISH:
            raise ValueError(f"ReAct cannot express a call to a tool named {call.name!r}")
        param = self.default_args.get(call.name)
        value = call.arguments.get(param) if param is not None and len(call.arguments) == 1 else None
        if isinstance(value, str) and value == value.strip() and "\n" not in value and not value.startswith("{"):
            return f"Action: {call.name}[{value}]"
        return f"Action: {call.name}[{json.dumps(call.arguments, ensure_ascii=False)}]"

    def format_answer(self, answer: str) -> str:
        """`Final Answer: answer`; ValueError if a line of it starts with `Action:` or `Final Answer:`."""
        if self._ACTION.search(answer) or self._FINAL.search(answer):
            raise ValueError(f"an answer cannot contain a line starting with 'Action:' or 'Final Answer:': {answer!r}")
        return f"Final Answer: {answer}"


class SearchR1Parser:
    """Search-R1 tags: `<search>query</search>` calls the search tool, `<answer>...</answer>` answers.

    The first opening tag decides; text after its closing tag is ignored (Search-R1 stops generating at
    `</search>`). `content` is the text before that tag (e.g. the `<think>` part), stripped.
    """

    template_syntax = False
    instructions = ("Think inside <think></think>; to search, write <search> query </search>; "
                    "when you know the final answer, write it inside <answer></answer>.")

    def __init__(self, tool_name: str = "search", arg_name: str = "query"):
        self.tool_name = tool_name
        self.arg_name = arg_name

    def parse(self, text: str) -> ParsedAction:
        """The first `<search>` or `<answer>` block as a call or the answer; an empty query is an error."""
        starts = [(i, tag) for tag in ("search", "answer") if (i := text.find(f"<{tag}>")) >= 0]
        if not starts:
            return ParsedAction(text.strip(), error="To search, put the query between <search> and </search>; "
                                                    "to give the final answer, put it between <answer> and </answer>.")
        start, tag = min(starts)
        content = text[:start].strip()
        inner_start = start + len(tag) + 2
        end = text.find(f"</{tag}>", inner_start)
        if end < 0:
            return ParsedAction(content, error=f"Unclosed <{tag}>: end it with </{tag}>.")
        inner = text[inner_start:end].strip()
        if tag == "answer":
            return ParsedAction(content, answer=inner)
        if not inner:
            return ParsedAction(content, error="The search query is empty: write <search> query </search>.")
        return ParsedAction(content, (ToolCall(self.tool_name, {self.arg_name: inner}),))

    def format_call(self, call: ToolCall) -> str:
        """`<search> query </search>`, spaced as Search-R1's prompt writes it: after a space, a name is the same
        tokens as in the question and the documents (Qwen2-style BPE keeps a word's leading space in its first
        token), so a model copies it token for token.

        ValueError for any call but `tool_name` with one argument, `arg_name`: a non-empty string without `</search>`.
        """
        query = call.arguments.get(self.arg_name)
        if call.name != self.tool_name or set(call.arguments) != {self.arg_name} or not isinstance(query, str):
            raise ValueError(f"Search-R1 can only express {self.tool_name}({self.arg_name}: str), got {call}")
        if not query.strip():
            raise ValueError("a Search-R1 query cannot be empty")
        _check_free_of(query, ("</search>",), "a Search-R1 query")
        return f"<search> {query} </search>"

    def format_answer(self, answer: str) -> str:
        """`<answer> answer </answer>` (spaced like `format_call`); ValueError if it holds `</answer>`."""
        _check_free_of(answer, ("</answer>",), "a Search-R1 answer")
        return f"<answer> {answer} </answer>"


PARSERS: dict[str, type[HermesParser] | type[ReActParser] | type[SearchR1Parser]] = {
    "hermes": HermesParser,
    "react": ReActParser,
    "search_r1": SearchR1Parser,
}
