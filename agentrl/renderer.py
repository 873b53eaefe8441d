"""The renderer: the only place where chat messages become token ids.

A trajectory is built append-only, exactly as the policy saw it:

    prompt ids  = encode(template(first messages, add_generation_prompt=True))
    turn k      = the sampled ids, verbatim                                    (loss_mask 1)
                + observation ids = encode(delta_k)                            (loss_mask 0)

`delta_k` is the text that the chat template adds after the assistant's turn: whatever follows the
turn-end marker that closes that turn (e.g. the "\\n" after `<|im_end|>`), the observation messages,
and the next generation prompt. It is found by rendering the conversation up to the assistant's turn
and with the observation, and cutting the latter right after the turn-end marker that closes the
assistant's turn (the n-th marker, where n counts the markers up to and including that turn). If the
policy stopped without emitting a marker (length limit or a stop string), the marker is put into the
delta too, so the next turn always starts from a well-formed context.

Templates that rewrite earlier turns (Qwen3 dropping `<think>` before the last user query,
DeepSeek-R1 dropping reasoning, gpt-oss dropping analysis, Mistral moving the system prompt) are
handled by this append-only strategy: earlier turns are never re-rendered, so the trajectory is the
context the model actually sampled from, which is what on-policy training needs. For such templates the
trajectory can differ from rendering the final conversation from scratch; for prefix-stable templates
(Qwen2.5, Hermes, Llama 3, Phi-4, Gemma...) the two are identical, which the tests check.
"""

from __future__ import annotations

import json
from functools import cached_property
from typing import Any, Sequence

from agentrl.types import Message

Ids = list[int]


class RendererError(ValueError):
    """The chat template cannot express this conversation (it drops a message or never ends a turn)."""


# gpt-oss ends a final answer with <|return|>, but a tool-call turn with <|call|> and an earlier turn with
# <|end|>; the probe below only sees the first.
EXTRA_TURN_ENDS = {"<|return|>": ("<|call|>", "<|end|>")}


class Renderer:
    """Chat messages to token ids through a tokenizer's chat template, append-only as described above."""

    def __init__(self, tokenizer: Any, turn_end: Sequence[str] | None = None,
                 template_kwargs: dict[str, Any] | None = None):
        """`tokenizer`: a Hugging Face tokenizer with a chat template. `turn_end`: the special tokens that
        close an assistant turn (default: found by rendering a probe conversation). `template_kwargs` go to
        the template (e.g. `enable_thinking=False`)."""
        if not getattr(tokenizer, "chat_template", None):
            raise RendererError("The tokenizer has no chat_template; set tokenizer.chat_template to a Jinja "
                                "template (see the model card) before rendering.")
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self._shows_tools: bool | None = None  # found at the first render with tools
        self.turn_end = tuple(turn_end or self._detect_turn_end())
        # by the vocabulary: convert_tokens_to_ids maps an unknown string to the unknown token, a real token itself
        # (SmolLM2's <|endoftext|>)
        vocab = tokenizer.get_vocab()
        if any(m not in vocab for m in self.turn_end):
            raise RendererError(f"Turn-end markers {self.turn_end} must each be one token of the tokenizer.")
        self.turn_end_ids = tuple(vocab[m] for m in self.turn_end)

    def _detect_turn_end(self) -> tuple[str, ...]:
        """The first special token that the template writes after an assistant message's content."""
        probe = "PROBE"
        text = self.render([Message("user", "Hi"), Message("assistant", probe)], tools=[])  # Hermes needs a list
        special = set(self.tokenizer.all_special_ids) | set(self.tokenizer.added_tokens_decoder)
        for i in self.encode(text[text.rindex(probe) + len(probe):]):
            if i in special:
                marker = self.tokenizer.convert_ids_to_tokens(i)
                return (marker, *EXTRA_TURN_ENDS.get(marker, ()))
        raise RendererError("This chat template ends an assistant turn with no special token of the tokenizer, and "
                            "sampling stops at that token: choose a template that writes one (`--chat-template "
                            "chatml-tools`, `chat_template = ...` in a recipe, or your own file whose assistant turn "
                            "ends with e.g. <|im_end|>); from Python, Renderer(tokenizer, turn_end=[...]) names it.")

    # ---- text ----
    def render(self, messages: Sequence[Message], tools: Sequence[dict] | None = None,
               add_generation_prompt: bool = False) -> str:
        """The conversation as text by the chat template (with `tools`, and the generation prompt if asked).

        Raises `RendererError` if there are tools and the template does not write them (the model would never
        see them)."""
        if tools and not self.shows_tools:
            raise RendererError("This chat template does not show tools to the model (SmolLM2's own, for one, has "
                                "none): choose one that does, e.g. chat_template = 'chatml-tools' (`--chat-template`"
                                "), the project's ChatML with Hermes tool calls")
        return self._apply(messages, tools, add_generation_prompt)

    @property
    def shows_tools(self) -> bool:
        """Whether the template writes a tool's schema into the prompt."""
        if self._shows_tools is None:
            probe = {"type": "function", "function": {"name": "agentrl_probe_tool", "description": "",
                                                      "parameters": {"type": "object", "properties": {}}}}
            self._shows_tools = "agentrl_probe_tool" in self._apply([Message("user", "Hi")], [probe], True)
        return self._shows_tools

    def _apply(self, messages: Sequence[Message], tools: Sequence[dict] | None, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            [m.to_dict() for m in messages], tools=None if tools is None else list(tools), tokenize=False,
            add_generation_prompt=add_generation_prompt, **self.template_kwargs)

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one token of the vocabulary stands for: a text of n characters is at least
        n / max_token_chars tokens, known without tokenizing it."""
        return max(map(len, self.tokenizer.get_vocab()))

    def encode(self, text: str) -> Ids:
        """Text (with special tokens written out, as templates produce them) to ids; no BOS/EOS added."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        """Ids to text, special tokens written out."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    # ---- ids ----
    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[dict] | None = None) -> Ids:
        """The ids of the conversation followed by the generation prompt: what the policy continues."""
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def observation_ids(self, history: Sequence[Message], assistant: Message, observation: Sequence[Message],
                        sampled_ids: Sequence[int], tools: Sequence[dict] | None = None) -> Ids:
        """Ids that follow the sampled ids of `assistant`: the rest of its turn, `observation`, and the
        next generation prompt. `history` is the conversation before `assistant`."""
        return self.encode(self.observation_text(history, assistant, observation, sampled_ids, tools))

    def observation_text(self, history: Sequence[Message], assistant: Message, observation: Sequence[Message],
                         sampled_ids: Sequence[int], tools: Sequence[dict] | None = None) -> str:
        """The text of `observation_ids` (`delta_k` above), led by the turn-end marker if the policy did not write it.

        Raises `RendererError` when the template does not close the assistant's turn with a `turn_end` marker, or
        drops an observation message."""
        before = self.render([*history], tools, add_generation_prompt=True)
        upto = self.render([*history, assistant], tools, add_generation_prompt=False)
        full = self.render([*history, assistant, *observation], tools, add_generation_prompt=True)
        n = self._count_markers(upto)  # gpt-oss writes two markers for a turn: its analysis and its call
        if n <= self._count_markers(before):
            raise RendererError(f"The chat template does not close an assistant turn with one of {self.turn_end} "
                                f"here; pass the right `turn_end` markers for this model.")
        start, end = self._nth_marker(full, n)
        delta = full[end:]
        for m in observation:
            if m.content.strip() and m.content.strip() not in delta and json.dumps(m.content)[1:-1] not in delta:
                raise RendererError(f"The chat template dropped a {m.role!r} message ({m.content[:40]!r}...): "
                                    f"this model's template cannot show the environment's observations.")
        if not sampled_ids or sampled_ids[-1] not in self.turn_end_ids:
            delta = full[start:end] + delta  # the policy did not close its turn: close it for the next one
        return delta

    @property
    def generation_prompt(self) -> str:
        """The text that opens an assistant turn (e.g. "<|im_start|>assistant\n")."""
        probe = [Message("user", "Hi")]
        with_prompt = self.render(probe, tools=[], add_generation_prompt=True)
        return with_prompt[len(self.render(probe, tools=[])):]

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Token ids that end an assistant turn; pass them to the sampler."""
        return self.turn_end_ids

    def _count_markers(self, text: str) -> int:
        return sum(text.count(m) for m in self.turn_end)

    def _nth_marker(self, text: str, n: int) -> tuple[int, int]:
        """(start, end) of the n-th (1-based) turn-end marker in `text`, in reading order."""
        positions = sorted((i, i + len(m)) for m in self.turn_end for i in _find_all(text, m))
        if len(positions) < n:  # e.g. Llama 3.1 ends a built-in tool's call with <|eom_id|>, not <|eot_id|>
            raise RendererError(f"The chat template closes the assistant's turn with none of {self.turn_end} once an "
                                f"observation follows it ({len(positions)} markers where {n} were expected): pass "
                                f"every marker it writes there as `turn_end`.")
        return positions[n - 1]


def _find_all(text: str, sub: str) -> list[int]:
    out, i = [], text.find(sub)
    while i != -1:
        out.append(i)
        i = text.find(sub, i + len(sub))
    return out
