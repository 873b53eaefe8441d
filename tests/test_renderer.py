"""The renderer against real chat templates (tests/data/chat_templates, copied from ../shared).

Each template gets a tokenizer that knows its special tokens (the tiny model's BPE plus those tokens).
A scripted "canonical" policy emits, for each assistant message, exactly the text the template writes
for it, tokenized canonically. Then:
- where the template is prefix-stable on the conversation, the trajectory's ids equal the tokenized
  rendering of the final conversation (up to the text after the last turn-end marker);
- with any policy, the trajectory is prompt ids + sampled ids + observation deltas, the mask is 1 on
  exactly the sampled ids, and every observation's content is in its delta;
- decode -> parse -> render round-trips for the templates that use Hermes-style <tool_call> blocks.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st
from transformers import AutoTokenizer

from agentrl.renderer import Renderer, RendererError
from agentrl.tools import HermesParser
from agentrl.types import Message, ToolCall

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"

SPECIALS = {  # template -> (bos, eos, other special tokens)
    "qwen2_5": (None, "<|im_end|>", ["<|im_start|>"]),
    "qwen3": (None, "<|im_end|>", ["<|im_start|>"]),
    "qwen3_2025-05": (None, "<|im_end|>", ["<|im_start|>"]),
    "hermes": ("<|begin_of_text|>", "<|im_end|>", ["<|im_start|>"]),
    "phi4": (None, "<|im_end|>", ["<|im_start|>", "<|im_sep|>"]),
    "llama3_1": ("<|begin_of_text|>", "<|eot_id|>",
                 ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"]),
    "llama3_2": ("<|begin_of_text|>", "<|eot_id|>", ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>"]),
    "mistral_v0_3": ("<s>", "</s>", ["[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                                     "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]),
    "deepseek_r1_distill": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", ["<｜User｜>", "<｜Assistant｜>"]),
    "gpt_oss": (None, "<|return|>", ["<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|call|>",
                                      "<|constrain|>"]),
    "gemma2": ("<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>"]),
    "gemma3": ("<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>", "<start_of_image>"]),
    "phi3_5": (None, "<|endoftext|>", ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]),
}
# Templates that can render a tool conversation (the others drop tool messages or raise; see the README).
TOOL_TEMPLATES = ["qwen2_5", "qwen3", "qwen3_2025-05", "hermes", "llama3_1", "llama3_2", "mistral_v0_3", "gpt_oss"]
# Where rendering the final conversation equals the append-only trajectory. The others rewrite earlier
# turns (see agentrl/renderer.py); this list guards against the property test passing vacuously.
PREFIX_STABLE = {
    # Hermes: no "\n" between </tool_response> and <|im_end|> before a generation prompt, one after.
    # gpt-oss: a tool-call turn's content (analysis channel) is dropped once a final answer follows.
    "tools": {"qwen2_5", "qwen3", "qwen3_2025-05", "llama3_1", "llama3_2"},
    # DeepSeek-R1: the generation prompt opens <think>, which the rendered assistant message lacks.
    "chat": {"qwen2_5", "qwen3", "qwen3_2025-05", "hermes", "phi4", "llama3_1", "llama3_2", "mistral_v0_3",
             "gemma2", "gemma3", "phi3_5", "gpt_oss"},
}

CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}}


def call(expr: str) -> tuple[ToolCall, ...]:
    return (ToolCall("calculator", {"expression": expr}, id="call00000"),)


TOOL_CONVERSATION = (
    [Message("system", "You are a careful assistant."), Message("user", "What is 3 * 4 plus 5?")],
    [(Message("assistant", "I will compute.", call("3 * 4")),
      [Message("tool", "12", tool_call_id="call00000", name="calculator")]),
     (Message("assistant", "Now add 5.", call("12 + 5")),
      [Message("tool", "17", tool_call_id="call00000", name="calculator")]),
     (Message("assistant", "The answer is 17."), [])],
)
CHAT_CONVERSATION = (
    [Message("user", "Hello there.")],
    [(Message("assistant", "Hi! How can I help?"), [Message("user", "Add 2 and 3.")]),
     (Message("assistant", "2 + 3 = 5."), [Message("user", "Thanks, and times 4?")]),
     (Message("assistant", "5 * 4 = 20."), [])],
)


@pytest.fixture(scope="module")
def base_tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def renderer_for(base_tokenizer, name: str) -> Renderer:
    """A renderer of the named template, its tokenizer knowing the template's special tokens."""
    bos, eos, extra = SPECIALS[name]
    tok = copy.deepcopy(base_tokenizer)
    specials = {"eos_token": eos, "additional_special_tokens": extra}
    if bos:
        specials["bos_token"] = bos
    tok.add_special_tokens(specials)
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return Renderer(tok)


@pytest.fixture(scope="module")
def renderers(base_tokenizer):
    return {name: renderer_for(base_tokenizer, name) for name in SPECIALS}


def simulate(r: Renderer, conversation, tools, sample_text=None):
    """Play the conversation through the renderer. The policy's text for each assistant message is the
    template's own text for it (canonical policy), or `sample_text(k)` if given. Returns the trajectory's
    ids, mask, the per-turn (sampled, delta) ids and whether the template was prefix-stable on the way."""
    first, turns = conversation
    history = list(first)
    ids = r.prompt_ids(history, tools)
    mask, parts, stable = [0] * len(ids), [], True
    for k, (assistant, obs) in enumerate(turns):
        last = k == len(turns) - 1
        context = r.render(history, tools, add_generation_prompt=True)
        after = r.render(history + [assistant, *obs], tools, add_generation_prompt=not last)
        stable &= after.startswith(context)
        if sample_text is None:
            text = _canonical_text(context, after, r)
        else:
            text = sample_text(k)
        sampled = r.encode(text)
        ids += sampled
        mask += [1] * len(sampled)
        delta = [] if last else r.observation_ids(history, assistant, obs, sampled, tools)
        ids += delta
        mask += [0] * len(delta)
        parts.append((sampled, delta))
        history += [assistant, *obs]
    return ids, mask, parts, stable, history


def _canonical_text(context: str, after: str, r: Renderer) -> str:
    """The template's text for the assistant message: in `after`, from the generation prompt that
    `context` ends with (searched from where the two renderings part) through the first turn-end marker."""
    generation_prompt = context[max([context.rfind(m) + len(m) for m in r.turn_end if m in context], default=0):]
    parted = len(os.path.commonprefix([context, after]))
    start = after.find(generation_prompt, max(0, parted - len(generation_prompt))) + len(generation_prompt)
    text = after[start:]
    ends = [text.find(m) + len(m) for m in r.turn_end if m in text]
    return text[:min(ends)] if ends else text


def chat_tools(name: str) -> list | None:
    return [] if name == "hermes" else None  # Hermes' template iterates over `tools` unconditionally


CASES = [(name, "tools") for name in TOOL_TEMPLATES] + [(name, "chat") for name in SPECIALS]


@pytest.mark.parametrize("name,kind", CASES)
def test_canonical_policy_matches_template_rendering(renderers, name, kind):
    r = renderers[name]
    conversation, tools = (TOOL_CONVERSATION, [CALC]) if kind == "tools" else (CHAT_CONVERSATION, chat_tools(name))
    ids, mask, parts, stable, history = simulate(r, conversation, tools)
    assert stable == (name in PREFIX_STABLE[kind]), f"{name} prefix-stability changed on the {kind} conversation"
    prompt_len = len(r.prompt_ids(conversation[0], tools))
    assert ids == r.prompt_ids(conversation[0], tools) + [i for s, d in parts for i in s + d]
    assert mask == [0] * prompt_len + [m for s, d in parts for m in [1] * len(s) + [0] * len(d)]
    if stable:
        final = r.encode(r.render(history, tools, add_generation_prompt=False))
        assert final[:len(ids)] == ids
        rest = r.decode(final[len(ids):])
        assert rest.strip() in ("", r.tokenizer.eos_token), f"unexpected text after the last turn: {rest!r}"


@pytest.mark.parametrize("name", ["qwen2_5", "qwen3", "hermes"])
def test_decode_parse_render_round_trip(renderers, name):
    r, parser = renderers[name], HermesParser()
    _, _, parts, _, _ = simulate(r, TOOL_CONVERSATION, [CALC])
    for (sampled, _), (assistant, _) in zip(parts, TOOL_CONVERSATION[1]):
        text = r.decode(sampled[:-1] if sampled[-1] in r.stop_token_ids else sampled)
        parsed = parser.parse(text)
        assert parsed.error is None
        assert [(c.name, c.arguments) for c in parsed.tool_calls] == [(c.name, c.arguments) for c in assistant.tool_calls]
        again = Message("assistant", parsed.content, tuple(c for c in assistant.tool_calls))
        assert r.render([*TOOL_CONVERSATION[0], again], [CALC]) == r.render([*TOOL_CONVERSATION[0], assistant], [CALC])


texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)


@pytest.mark.parametrize("name,kind", CASES)
@settings(max_examples=15, deadline=None)
@given(contents=st.lists(texts, min_size=3, max_size=3), closes=st.lists(st.booleans(), min_size=3, max_size=3))
def test_any_policy_gives_prompt_plus_sampled_plus_deltas(renderers, name, kind, contents, closes):
    """Whatever the policy samples (closing its turn or not), the deltas are well-formed: each holds its
    observations, starts with the turn-end marker iff the policy did not close its turn, and the mask is
    exactly on the sampled ids."""
    r = renderers[name]
    conversation, tools = (TOOL_CONVERSATION, [CALC]) if kind == "tools" else (CHAT_CONVERSATION, chat_tools(name))
    marker = r.turn_end[0]
    ids, mask, parts, _, _ = simulate(r, conversation, tools,
                                      sample_text=lambda k: contents[k] + (marker if closes[k] else ""))
    assert sum(mask) == sum(len(s) for s, _ in parts)
    assert [i for i, m in zip(ids, mask) if m] == [i for s, _ in parts for i in s]
    for k, ((sampled, delta), (_, obs)) in enumerate(zip(parts, conversation[1])):
        if not obs:
            continue
        text = r.decode(delta)
        closed = bool(sampled) and sampled[-1] in r.stop_token_ids
        assert any(text.startswith(m) for m in r.turn_end) == (not closed), text[:40]
        for m in obs:
            assert m.content in text or f'"{m.content}"' in text


def test_template_that_drops_tool_messages_is_an_error(renderers):
    r = renderers["phi4"]  # phi-4 silently drops tool messages, and the tools themselves
    first, turns = TOOL_CONVERSATION
    assistant, obs = turns[0]
    with pytest.raises(RendererError, match="dropped"):
        r.observation_ids(first, assistant, obs, r.encode("x" + r.turn_end[0]))
    long = Message("tool", "0123456789" * 5, tool_call_id="call00000")  # the error shows its first 40 characters
    with pytest.raises(RendererError, match=r"dropped a 'tool' message \('0123456789012345678901234567890123456789'"
                                            r"\.\.\.\)"):
        r.observation_ids(first, assistant, [long], r.encode("x" + r.turn_end[0]))
    with pytest.raises(RendererError, match="does not show tools.*chatml-tools") as e:
        r.prompt_ids(first, [CALC])
    assert str(e.value) == ("This chat template does not show tools to the model (SmolLM2's own, for one, has none): "
                            "choose one that does, e.g. chat_template = 'chatml-tools' (`--chat-template`), the "
                            "project's ChatML with Hermes tool calls")
    assert renderers["qwen2_5"].shows_tools and not r.shows_tools


def test_an_observation_the_template_writes_escaped_is_found(renderers):
    r = renderers["llama3_1"]  # Llama 3 writes a tool's output as a JSON string
    first, turns = TOOL_CONVERSATION
    output = 'say "hi"\nthen'
    delta = r.observation_text(first, turns[0][0], [Message("tool", output, tool_call_id="call00000")], [], [CALC])
    assert output not in delta and '"say \\"hi\\"\\nthen"<|eot_id|>' in delta


def test_a_template_that_leaves_the_assistants_turn_open_is_refused_with_the_markers_named(base_tokenizer):
    tok = copy.deepcopy(base_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    history, assistant = [Message("user", "Hi")], Message("assistant", "Hello.")
    observation = [Message("user", "And then?")]
    never = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    # closes the assistant's turn only while it is the last message: an observation after it finds no marker
    only_last = ("{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'user' and not loop.last or "
                 "m['role'] == 'assistant' and loop.last %}<|im_end|>{% endif %}{% endfor %}")
    for template, message in [(never, r"does not close an assistant turn with one of \('<\|im_end\|>',\) here"),
                              (only_last, r"none of \('<\|im_end\|>',\) once an observation follows it \(1 "
                                          r"markers where 2 were expected\): pass every marker")]:
        tok.chat_template = template
        with pytest.raises(RendererError, match=message):
            Renderer(tok, turn_end=["<|im_end|>"]).observation_text(history, assistant, observation, [])


def test_the_template_gets_its_arguments_and_encoding_adds_no_bos(renderers):
    qwen3 = renderers["qwen3"].tokenizer
    assert Renderer(qwen3).generation_prompt == "<|im_start|>assistant\n"
    assert Renderer(qwen3, template_kwargs={"enable_thinking": False}).generation_prompt == \
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    from tokenizers.processors import TemplateProcessing

    tok = copy.deepcopy(qwen3)  # as Llama's tokenizer does, a BOS before every encoding that asks for one
    tok.add_special_tokens({"bos_token": "<|bos|>"})
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<|bos|> $A",
                                                             special_tokens=[("<|bos|>", tok.bos_token_id)])
    assert tok("Hi")["input_ids"][0] == tok.bos_token_id
    assert Renderer(tok).encode("Hi") == tok("Hi")["input_ids"][1:]  # the template writes its own BOS


def test_turn_end_detection(base_tokenizer):
    # built here, not taken from the module's fixture: mutation testing maps a function to the tests that call it,
    # and the fixture's calls count only for the first test that used it (docs/mutation.md)
    detected = {name: renderer_for(base_tokenizer, name).turn_end for name in
                ("qwen2_5", "llama3_1", "gemma2", "phi3_5", "gpt_oss")}
    assert detected == {"qwen2_5": ("<|im_end|>",), "llama3_1": ("<|eot_id|>",), "gemma2": ("<end_of_turn>",),
                        "phi3_5": ("<|end|>",), "gpt_oss": ("<|return|>", "<|call|>", "<|end|>")}


def test_the_turn_end_is_the_first_added_token_after_the_content(base_tokenizer):
    """Not a special token before the content (<a> opens every turn here), and an added token counts though the
    tokenizer does not list it as special (a fine-tune's new <|eot|>)."""
    tok = copy.deepcopy(base_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<a>"]})
    tok.add_tokens(["<|eot|>"])
    assert tok.convert_tokens_to_ids("<|eot|>") not in tok.all_special_ids
    tok.chat_template = "{% for m in messages %}<a>{{ m['content'] }}<|eot|>{% endfor %}"
    assert Renderer(tok).turn_end == ("<|eot|>",)


def test_a_template_without_a_turn_end_token_names_a_fix_the_cli_takes(base_tokenizer):
    tok = copy.deepcopy(base_tokenizer)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}"
    with pytest.raises(RendererError, match="no special token of the tokenizer.*--chat-template chatml-tools") as e:
        Renderer(tok)
    assert str(e.value).startswith("This chat template ends an assistant turn with no special token")
    assert str(e.value).endswith("from Python, Renderer(tokenizer, turn_end=[...]) names it.")


def test_a_tokenizer_without_a_chat_template_or_with_a_marker_of_several_tokens_is_refused(base_tokenizer):
    bare = copy.deepcopy(base_tokenizer)
    bare.chat_template = None
    for tokenizer in (bare, object()):  # no template, or no attribute for one at all
        with pytest.raises(RendererError) as e:
            Renderer(tokenizer)
        assert str(e.value) == ("The tokenizer has no chat_template; set tokenizer.chat_template to a Jinja "
                                "template (see the model card) before rendering.")
    tok = copy.deepcopy(base_tokenizer)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    with pytest.raises(RendererError, match=r"Turn-end markers \('</turn>',\) must each be one token"):
        Renderer(tok, turn_end=["</turn>"])
