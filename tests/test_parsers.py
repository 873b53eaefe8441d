"""Parsers: examples of each format and each malformation, round trips, and fuzzing (parse never raises)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.tools import PARSERS, HermesParser, ParsedAction, ReActParser, SearchR1Parser
from agentrl.types import ToolCall

QWEN25_TEMPLATE = Path(__file__).parent / "data" / "chat_templates" / "qwen2_5.jinja"
ALL_PARSERS = [HermesParser(), ReActParser({"search": "query"}), SearchR1Parser()]


def ok(content: str, calls=(), answer=None) -> ParsedAction:
    return ParsedAction(content, tuple(calls), answer)


# ---------------------------------------------------------------- Hermes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('I will search.\n<tool_call>\n{"name": "search", "arguments": {"query": "Paris"}}\n</tool_call>',
         ok("I will search.", [ToolCall("search", {"query": "Paris"})])),
        ('<tool_call>  {"name": "a", "arguments": {}}  </tool_call><tool_call>{"name": "b", "arguments": {"n": 1}}'
         "</tool_call>", ok("", [ToolCall("a", {}), ToolCall("b", {"n": 1})])),
        ("It is <answer> 42 </answer>", ok("It is <answer> 42 </answer>", answer="42")),
        ("<answer>draft</answer> no, <answer>final</answer>", ok("<answer>draft</answer> no, <answer>final</answer>",
                                                                  answer="final")),
        ("  Just talking.  ", ok("Just talking.")),
        ('<tool_call>{"name": "w", "arguments": {"html": "<answer>x</answer>"}}</tool_call>',
         ok("", [ToolCall("w", {"html": "<answer>x</answer>"})])),  # tags inside a call are its arguments
    ],
)
def test_hermes_parses(text, expected):
    assert HermesParser().parse(text) == expected


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('<tool_call>\n{"name": "a" "arguments": {}}\n</tool_call>',
         "Invalid JSON in <tool_call>: Expecting ',' delimiter at char 13"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'A <tool_call> needs a "name"'),
        ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', 'A <tool_call> needs a "name"'),
        ('<tool_call>{"name": "a"}</tool_call>', 'The <tool_call> for a needs "arguments"'),
        ('<tool_call>{"name": "a", "arguments": "{}"}</tool_call>',
         '"arguments" of a must be a JSON object, got a string'),
        ('<tool_call>["a"]</tool_call>', "<tool_call> must hold a JSON object, got an array"),
        ('<tool_call>{"name": "a", "arguments": {}}', "Unclosed <tool_call>"),
        ("<tool_call>" + "[" * 5000 + "</tool_call>", "Invalid JSON in <tool_call>: nested too deeply"),
        ('<tool_call>{"name": "a", "arguments": {"n": ' + "9" * 5000 + "}}</tool_call>",
         "Invalid JSON in <tool_call>: Exceeds the limit (4300 digits) for integer string conversion"),
        ('<tool_call>{"name": "a", "arguments": {"code": "print(\'\\ud800\')"}}</tool_call>',
         "Invalid JSON in <tool_call>: \\ud800 is half of a surrogate pair, not a character"),
        ('<tool_call>{"name": "a", "arguments": {"\\udfff": 1}}</tool_call>', "\\udfff is half of a surrogate pair"),
        ("<answer>4", "Unclosed <answer>"),
        ("4</answer>", "Found </answer> without <answer>"),
        ('<tool_call>{"name": "a", "arguments": {}}</tool_call><answer>4</answer>', "not both in one turn"),
    ],
)
def test_hermes_errors(text, error):
    parsed = HermesParser().parse(text)
    assert parsed.error is not None and error in parsed.error, parsed.error
    assert parsed.tool_calls == () and parsed.answer is None


def test_hermes_format_matches_the_qwen25_template_byte_for_byte():
    from transformers.utils.chat_template_utils import render_jinja_template

    calls = [ToolCall("search", {"query": 'é "quoted" \\ ü', "n": [1, 2.5, True, None]}), ToolCall("noop", {})]
    message = {"role": "assistant", "content": "", "tool_calls": [c.to_dict() for c in calls]}
    rendered, _ = render_jinja_template([[{"role": "user", "content": "hi"}, message]],
                                        chat_template=QWEN25_TEMPLATE.read_text())
    body = "\n".join(HermesParser().format_call(c) for c in calls)
    assert rendered[0].endswith(f"<|im_start|>assistant\n{body}<|im_end|>\n")
    assert HermesParser().parse(body) == ok("", calls)


# ---------------------------------------------------------------- ReAct


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('Thought: I need the capital.\nAction: search[{"query": "capital of France"}]',
         ok("I need the capital.", [ToolCall("search", {"query": "capital of France"})])),
        ("Thought: look it up\nAction: search[capital of [France]]\n",
         ok("look it up", [ToolCall("search", {"query": "capital of [France]"})])),
        ("Action: lookup[]", ok("", [ToolCall("lookup", {})])),
        ("Thought: done.\nFinal Answer: Paris\nis the capital", ok("done.", answer="Paris\nis the capital")),
        ("Thought: done.\nAction: finish[Paris]", ok("done.", answer="Paris")),
        ('Thought: I need to write "Action: x" later\n  Action : calc[{"e": "1+1"}]',
         ok('I need to write "Action: x" later', [ToolCall("calc", {"e": "1+1"})])),
    ],
)
def test_react_parses(text, expected):
    assert ReActParser({"search": "query"}).parse(text) == expected


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("Thought: hmm", "Write 'Action: <tool>[<arguments>]'"),
        ("Action: search[a]\nAction: search[b]", "Write one Action per turn; you wrote 2."),
        ("Action: search[a]\nFinal Answer: b", "Write either an Action or a Final Answer, not both."),
        ("Action: search(a)", "Could not read the Action."),
        ("Action: search[a]\nObservation: made up", "Could not read the Action."),
        ("Action: lookup[Paris]", 'Pass the arguments of lookup as a JSON object, e.g. Action: lookup[{"argument"'),
        ('Action: search[{"query": "a",}]', "Invalid JSON in the arguments of search: Expecting property name"),
        ("Action: search[{} {}]", "Invalid JSON in the arguments of search: Extra data at char 3"),
    ],
)
def test_react_errors(text, error):
    parsed = ReActParser({"search": "query"}).parse(text)
    assert parsed.error is not None and parsed.error.startswith(error), parsed.error
    assert parsed.tool_calls == () and parsed.answer is None


def test_react_formats_single_string_arguments_as_plain_text():
    parser = ReActParser({"search": "query"})
    assert parser.format_call(ToolCall("search", {"query": "Paris"})) == "Action: search[Paris]"
    assert parser.format_call(ToolCall("search", {"query": "a\nb"})) == 'Action: search[{"query": "a\\nb"}]'
    assert parser.format_call(ToolCall("calc", {"e": "1"})) == 'Action: calc[{"e": "1"}]'
    with pytest.raises(ValueError):
        parser.format_call(ToolCall("finish", {}))
    with pytest.raises(ValueError):
        parser.format_answer("x\nAction: search[y]")


# ---------------------------------------------------------------- Search-R1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>need facts</think>\n<search> capital of France </search>",
         ok("<think>need facts</think>", [ToolCall("search", {"query": "capital of France"})])),
        ("<search>a</search><answer>b</answer>", ok("", [ToolCall("search", {"query": "a"})])),
        ("<think>ok</think><answer> Paris </answer><search>x</search>", ok("<think>ok</think>", answer="Paris")),
        ("<search>a</search> made-up <information>...</information>", ok("", [ToolCall("search", {"query": "a"})])),
        ("<answer></answer>", ok("", answer="")),
    ],
)
def test_search_r1_parses(text, expected):
    assert SearchR1Parser().parse(text) == expected


def test_search_r1_tool_and_argument_names_are_configurable():
    parser = SearchR1Parser(tool_name="retrieve", arg_name="q")
    assert parser.parse("<search>x</search>").tool_calls == (ToolCall("retrieve", {"q": "x"}),)
    assert parser.format_call(ToolCall("retrieve", {"q": "x"})) == "<search> x </search>"
    with pytest.raises(ValueError, match="can only express retrieve"):
        parser.format_call(ToolCall("search", {"query": "x"}))


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<think>no action</think>", "To search, put the query between <search> and </search>"),
        ("<search>capital of", "Unclosed <search>: end it with </search>."),
        ("<answer>Paris", "Unclosed <answer>: end it with </answer>."),
        ("<search>  </search>", "The search query is empty"),
    ],
)
def test_search_r1_errors(text, error):
    parsed = SearchR1Parser().parse(text)
    assert parsed.error is not None and parsed.error.startswith(error), parsed.error
    assert parsed.tool_calls == () and parsed.answer is None


# ---------------------------------------------------------------- round trips

_ident_start = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_"
identifiers = st.builds(
    str.__add__, st.sampled_from(_ident_start), st.text(_ident_start + "0123456789", max_size=20)
).filter(lambda s: s != "finish")  # ReAct's reserved action
json_scalars = st.one_of(
    st.text(max_size=30), st.integers(-(10**12), 10**12), st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
)
json_values = st.one_of(json_scalars, st.lists(json_scalars, max_size=4))
tool_calls = st.builds(ToolCall, identifiers, st.dictionaries(identifiers, json_values, max_size=4))
answers = st.text(max_size=60).map(str.strip)


@settings(max_examples=300, deadline=None)
@given(call=tool_calls)
def test_hermes_and_react_calls_round_trip(call):
    for parser in (HermesParser(), ReActParser({call.name: "query"}), ReActParser()):
        try:
            text = parser.format_call(call)
        except ValueError:  # e.g. an argument that contains </tool_call>: the format cannot express it
            continue
        parsed = parser.parse("Thought: go\n" + text if isinstance(parser, ReActParser) else text)
        assert parsed.error is None, (text, parsed.error)
        assert parsed.tool_calls == (call,)


@settings(max_examples=300, deadline=None)
@given(query=st.text(min_size=1, max_size=60).map(str.strip).filter(bool))
def test_single_string_calls_round_trip(query):
    call = ToolCall("search", {"query": query})
    for parser in (SearchR1Parser(), ReActParser({"search": "query"})):  # ReAct writes plain text where it can
        try:
            text = parser.format_call(call)
        except ValueError:  # e.g. a query that contains </search>
            continue
        assert parser.parse("<think>x</think>\nThought: x\n" + text).tool_calls == (call,), text


@settings(max_examples=300, deadline=None)
@given(answer=answers)
def test_answers_round_trip(answer):
    for parser in ALL_PARSERS:
        try:
            text = parser.format_answer(answer)
        except ValueError:  # the answer contains the format's own markers
            continue
        parsed = parser.parse(text)
        assert parsed.error is None and parsed.answer == answer, (parser, text, parsed)


# ---------------------------------------------------------------- fuzzing

FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool_call>\n", "\n</tool_call>", "{", "}", "[", "]", '"', ":", ",", '"name"',
    '"arguments"', '"search"', "{}", "[]", "null", "true", "1e999", "-0", "9" * 5000, "[" * 5000, "{" * 3000,
    '{"a":' * 2000, "Action:", "Action: ", "Final Answer:", "Thought:", "finish", "search", "\n", " ", "\t", "\r\n",
    "<search>", "</search>", "<answer>", "</answer>", "<think>", "</think>", "<tool_call><tool_call>",
    "</answer></answer>", "\\", "\\u", "\\ud800", "\x00", "\u2028", "é", "🙂", "\ufeff",
]
adversarial = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=5)), max_size=30).map("".join)


def _mangle(call: ToolCall, cut: int, tail: str) -> str:
    """A valid Hermes call, cut short and given a stray tail."""
    text = f"<tool_call>\n{json.dumps({'name': call.name, 'arguments': call.arguments}, ensure_ascii=False)}\n</tool_call>"
    return text[: cut % (len(text) + 1)] + tail


valid_then_mangled = st.builds(_mangle, tool_calls, st.integers(0, 200), st.sampled_from(["", "x", "}", "]", "\n", '"']))


def assert_well_formed(parsed: ParsedAction) -> None:
    assert isinstance(parsed, ParsedAction)
    assert isinstance(parsed.content, str)
    assert isinstance(parsed.tool_calls, tuple)
    for call in parsed.tool_calls:
        assert isinstance(call, ToolCall) and isinstance(call.name, str) and isinstance(call.arguments, dict)
    assert parsed.answer is None or isinstance(parsed.answer, str)
    assert parsed.error is None or (isinstance(parsed.error, str) and parsed.error)
    if parsed.error is not None:
        assert parsed.tool_calls == () and parsed.answer is None


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(st.text(), adversarial, valid_then_mangled))
def test_parsers_never_raise(text):
    for parser in ALL_PARSERS + [ReActParser()]:
        assert_well_formed(parser.parse(text))
        # The same text inside each format's own wrappers reaches the deeper code paths.
        for wrapped in (f"<tool_call>{text}</tool_call>", f"Action: search[{text}]", f"<search>{text}</search>"):
            assert_well_formed(parser.parse(wrapped))


def test_every_parser_is_registered_and_has_one_line_instructions():
    assert PARSERS == {"hermes": HermesParser, "react": ReActParser, "search_r1": SearchR1Parser}
    for cls in PARSERS.values():
        assert isinstance(cls.instructions, str) and "\n" not in cls.instructions
        assert isinstance(cls().parse(json.dumps("x")), ParsedAction)
