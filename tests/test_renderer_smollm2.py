"""The renderer with a real pretrained tokenizer: SmolLM2-135M-Instruct's (49,152-token byte-level BPE).

Templates: SmolLM2's own (ChatML with a default system prompt, no tools), the project's `chatml-tools`, and
the shared templates of tests/data/chat_templates whose special tokens are all special tokens of SmolLM2's.
Checked:
- the turn end found is `<|im_end|>`; SmolLM2's own template refuses tools, naming chatml-tools;
- with a canonical policy (test_renderer's), multi-turn tool and chat conversations: the trajectory is
  the tokenized rendering of the final conversation, and decodes to it;
- with sampled ids that tokenize differently across a boundary (cut mid-word or mid-character, leading
  spaces, newlines before `<|im_end|>`, a word spelled letter by letter, multi-byte characters): the
  sampled ids are kept verbatim under the mask, each delta is exactly ChatML's text, and the whole
  sequence decodes to the rendered conversation;
- the rollout engine builds prompt + sampled + deltas from a policy that spells its answers.
"""

from __future__ import annotations

import asyncio

import pytest
from test_renderer import CALC, CHAT_CONVERSATION, SPECIALS, TEMPLATES, TOOL_CONVERSATION, simulate

from agentrl.envs.math import ArithmeticEnv
from agentrl.models.tokenizer import load_tokenizer
from agentrl.policy.protocol import Sample
from agentrl.renderer import Renderer, RendererError
from agentrl.rollout.engine import RolloutEngine
from agentrl.tools import HermesParser
from agentrl.types import Message, Status, StopReason

pytestmark = pytest.mark.real_model

IM_END = 2  # `<|im_end|>` is id 2 in SmolLM2's vocabulary (`<|im_start|>` is 1, `<|endoftext|>` 0)


@pytest.fixture(scope="module")
def own(smollm2_dir) -> Renderer:
    return Renderer(load_tokenizer(smollm2_dir))


@pytest.fixture(scope="module")
def tools_r(smollm2_dir) -> Renderer:
    return Renderer(load_tokenizer(smollm2_dir, chat_template="chatml-tools"))


@pytest.fixture(scope="module")
def shared(smollm2_dir) -> dict[str, Renderer]:
    """The shared templates whose special tokens (test_renderer.SPECIALS: bos, eos and the others) are all
    special tokens of SmolLM2's: the others would write markers that SmolLM2 reads as plain text."""
    tok = load_tokenizer(smollm2_dir)
    specials = {t.content for t in tok.added_tokens_decoder.values()}
    chosen = [name for name, (bos, eos, extra) in SPECIALS.items() if {bos, eos, *extra} - {None} <= specials]
    assert chosen, "no shared template fits SmolLM2's vocabulary"
    # at present the Qwen ones (ChatML): Hermes needs <|begin_of_text|>, Phi-4 <|im_sep|>
    return {name: Renderer(load_tokenizer(smollm2_dir, chat_template=str(TEMPLATES / f"{name}.jinja")))
            for name in chosen}


def test_turn_end_is_im_end_for_both_templates(own, tools_r, shared):
    for r in (own, tools_r, *shared.values()):
        assert r.turn_end == ("<|im_end|>",) and r.stop_token_ids == (IM_END,)
        assert r.encode("<|im_end|>") == [IM_END]  # one special token, not pieces of its text
        assert r.generation_prompt == "<|im_start|>assistant\n"
    # SmolLM2's unknown token is a real token of its own (<|endoftext|>, id 0): a marker, not an unknown string
    assert Renderer(own.tokenizer, turn_end=["<|endoftext|>"]).turn_end_ids == (0,)
    with pytest.raises(RendererError, match="must each be one token"):
        Renderer(own.tokenizer, turn_end=["<|no_such_marker|>"])


def test_own_template_refuses_tools_and_names_chatml_tools(own, tools_r):
    first, [(assistant, obs), *_] = TOOL_CONVERSATION
    assert not own.shows_tools and tools_r.shows_tools
    with pytest.raises(RendererError, match="chatml-tools"):
        own.prompt_ids(first, [CALC])
    with pytest.raises(RendererError, match="chatml-tools"):
        own.observation_ids(first, assistant, obs, own.encode("x<|im_end|>"), [CALC])
    assert own.prompt_ids(first, []) == own.prompt_ids(first)  # no tools: nothing to refuse


def canonical_cases(own, tools_r, shared):
    yield "own/chat", own, CHAT_CONVERSATION, None
    yield "chatml-tools/chat", tools_r, CHAT_CONVERSATION, None
    yield "chatml-tools/tools", tools_r, TOOL_CONVERSATION, [CALC]
    for name, r in shared.items():
        yield f"{name}/chat", r, CHAT_CONVERSATION, None
        yield f"{name}/tools", r, TOOL_CONVERSATION, [CALC]


def test_canonical_policy_gives_the_rendered_conversation(own, tools_r, shared):
    for case, r, conversation, tools in canonical_cases(own, tools_r, shared):
        ids, mask, parts, stable, history = simulate(r, conversation, tools)
        assert stable, case
        # the trajectory is the canonical tokenization of the final conversation, and decodes to it
        assert ids == r.encode(r.render(history, tools))[:len(ids)], case
        assert r.decode(ids) + "\n" == r.render(history, tools), case
        assert [i for i, m in zip(ids, mask) if m] == [i for s, _ in parts for i in s], case
        assert all(s[-1] == IM_END for s, _ in parts), case


def test_tool_calls_decode_and_parse_back(tools_r):
    _, _, parts, _, _ = simulate(tools_r, TOOL_CONVERSATION, [CALC])
    for (sampled, _), (assistant, _) in zip(parts, TOOL_CONVERSATION[1]):
        parsed = HermesParser().parse(tools_r.decode(sampled[:-1]))
        assert parsed.error is None and parsed.content == assistant.content
        assert [(c.name, c.arguments) for c in parsed.tool_calls] == [(c.name, c.arguments) for c in assistant.tool_calls]


def play(r: Renderer, first, turns, tools=None):
    """Turns of verbatim sampled ids, each followed by its observation; the assistant message is the decoded
    text without the turn end, as the rollout engine makes it. Returns ids, mask, deltas and the messages."""
    history, ids = list(first), r.prompt_ids(first, tools)
    mask, deltas = [0] * len(ids), []
    for sampled, obs in turns:
        assistant = Message("assistant", r.decode(sampled[:-1] if sampled[-1:] == [IM_END] else sampled))
        delta = r.observation_ids(history, assistant, obs, sampled, tools)
        ids, mask = ids + sampled + delta, mask + [1] * len(sampled) + [0] * len(delta)
        deltas.append(delta)
        history += [assistant, *obs]
    return ids, mask, deltas, history


def spelled(r: Renderer, text: str) -> list[int]:
    return [i for ch in text for i in r.encode(ch)]


LONG_WORD = "The answer is supercalifragilistic"  # the last word is 6 tokens
# name -> (sampled ids of each turn from the renderer, whether re-encoding the decoded trajectory changes it)
BOUNDARIES = {
    "cut mid-word": (lambda r: [r.encode(LONG_WORD)[:-1], r.encode("seventeen.") + [IM_END]], False),
    # the prompt's "\n" and a sampled leading " " are one token ("\n ") when encoded together
    "leading spaces": (lambda r: [r.encode("  Sure.") + [IM_END], r.encode(" \n  ok") + [IM_END]], True),
    # "\n\n" is one token before `<|im_end|>`; a sampled "\n" after the prompt's would merge with it
    "newlines before turn end": (lambda r: [r.encode("Done.\n\n") + [IM_END], r.encode("\n") + [IM_END]], True),
    "spelled": (lambda r: [spelled(r, "seventeen") + [IM_END], spelled(r, " 17 ") + [IM_END]], True),
    "multi-byte": (lambda r: [r.encode("日本語 😀 café") + [IM_END], r.encode("😀")[:1]], True),  # cut mid-emoji
}
OBSERVATIONS = ["ok\n", "  next"]  # a newline right before `<|im_end|>`, leading spaces after "user\n"


@pytest.mark.parametrize("case", BOUNDARIES)
@pytest.mark.parametrize("template", ["own", "chatml-tools"])
def test_sampled_ids_are_kept_verbatim_across_boundaries(own, tools_r, template, case):
    r = own if template == "own" else tools_r
    make, retokenizes = BOUNDARIES[case]
    turns = make(r)
    ids, mask, deltas, history = play(r, [Message("user", "What is 8 + 9?")],
                                      [(s, [Message("user", o)]) for s, o in zip(turns, OBSERVATIONS)])
    assert [i for i, m in zip(ids, mask) if m] == [i for s in turns for i in s]  # verbatim, mask exactly there
    for sampled, delta, obs in zip(turns, deltas, OBSERVATIONS):
        # the delta closes the turn only when the policy did not, and holds ChatML's text for the user turn
        close = "" if sampled[-1] == IM_END else "<|im_end|>"
        assert r.decode(delta) == f"{close}\n<|im_start|>user\n{obs}<|im_end|>\n<|im_start|>assistant\n"
        assert delta[0] == (IM_END if close else r.encode("\n")[0])
    assert r.decode(ids) == r.render(history, add_generation_prompt=True)
    # guard: the cases that should be hard are (re-tokenizing would change the ids); the others are not
    assert (r.encode(r.decode(ids)) != ids) == retokenizes


def test_boundary_cases_are_what_they_claim(tools_r):
    r = tools_r
    cut = r.decode(r.encode(LONG_WORD)[:-1])
    assert LONG_WORD.startswith(cut) and len(cut) > len("The answer is super")  # ends inside the word
    assert spelled(r, "seventeen") != r.encode("seventeen")  # not the canonical tokenization
    assert all(len(r.encode(ch)) > 1 for ch in "日語😀")  # each character split across tokens
    assert r.decode(r.encode("😀")[:1]) == "\ufffd"  # half a character


class SpellingPolicy:
    """Plays ArithmeticEnv's gold answers one character at a time (never canonical ids), then `<|im_end|>`."""

    weight_version = 0

    def __init__(self, r: Renderer, env: ArithmeticEnv):
        self.r, self.scripts = r, {t.data["question"]: env.gold_actions(t) for t in env.tasks}
        self.sampled: list[list[int]] = []

    async def generate(self, prompt_ids, sampling):
        prompt = self.r.decode(prompt_ids)
        script = next(v for k, v in self.scripts.items() if k in prompt)
        ids = spelled(self.r, script[prompt.count("<|im_start|>assistant") - 1]) + [IM_END]
        self.sampled.append(ids)
        return [Sample(tuple(ids), (0.0,) * len(ids), "stop")]


def run_one(r: Renderer):
    env = ArithmeticEnv(n_tasks=1)
    policy, task = SpellingPolicy(r, env), env.tasks[0]
    engine = RolloutEngine(lambda: ArithmeticEnv(n_tasks=1), policy, r)
    try:
        return asyncio.run(engine.run_episode(task, 0, 0)), policy, env
    finally:
        engine.close()


def test_engine_builds_prompt_plus_sampled_plus_deltas(tools_r):
    r = tools_r
    t, policy, env = run_one(r)
    assert t.status is Status.OK and t.reward == 1.0 and len(policy.sampled) == 2, t.reason
    first, call, result, answer = t.messages[:2], t.messages[2], t.messages[3], t.messages[4]
    assert policy.sampled[0] != r.encode(r.decode(policy.sampled[0]))  # spelled, not canonical
    delta = r.observation_ids(first, call, [result], policy.sampled[0], env.tool_schemas)
    assert r.decode(delta) == f"\n<|im_start|>user\n<tool_response>\n{result.content}\n</tool_response><|im_end|>\n" \
                              "<|im_start|>assistant\n"
    expected = r.prompt_ids(first, env.tool_schemas) + policy.sampled[0] + delta + policy.sampled[1]
    assert list(t.token_ids) == expected
    sampled_at = {i for turn in t.turns for i in range(turn.start, turn.end)}
    assert list(t.loss_mask) == [int(i in sampled_at) for i in range(len(expected))]
    assert [i for i, m in zip(t.token_ids, t.loss_mask) if m] == policy.sampled[0] + policy.sampled[1]
    assert r.decode(t.token_ids) + "\n" == r.render([*first, call, result, answer], env.tool_schemas)


def test_engine_with_own_template_is_a_render_error(own):
    t, policy, _ = run_one(own)
    assert t.stop is StopReason.RENDER_ERROR and "chatml-tools" in t.reason and not policy.sampled
