"""The tiny CPU model: a Qwen2-architecture causal LM and a byte-level BPE tokenizer, built offline.

There is no model hub in tests, CI or the CPU demo, so the project builds its own model (`agentrl model
init DIR`). The tokenizer is trained on a small corpus that the project generates itself (`training_corpus`);
the weights are random. Both `transformers` and vLLM load the result from DIR. Building is deterministic:
the same settings give byte-identical files, and a complete build with the same settings is not redone.

Two choices that vLLM on CPU forces (docs/vllm.md): head_dim 64 (CPU attention refuses 16) and untied
embeddings (with tied ones, vLLM's in-place weight reload silently leaves a mixed model).
"""

from __future__ import annotations

import hashlib
import json
import random
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Sequence

from rich.console import Console

from agentrl.models.record import BUILD_FILE, changed_files, write_record
from agentrl.models.tokenizer import CHAT_TEMPLATES

BUILD_FORMAT = 3  # bump when the corpus, the tokenizer recipe or the file layout changes
TEMPLATE_PATH = CHAT_TEMPLATES["chatml-tools"]  # the tiny model's own template
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END]
# Qwen2's pre-tokenizer split: digits one by one, words with their leading space, punctuation runs, newlines.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_console = Console(stderr=True)


@dataclass(frozen=True)
class TinyModelSettings:
    """Everything that determines the built files. Stored in `agentrl_build.json`."""

    seed: int = 0
    vocab_size: int = 4096  # BPE target; the model's vocab is the tokenizer's actual size
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4  # head_dim = hidden_size / num_heads = 64: vLLM's CPU attention needs >= 64
    num_kv_heads: int = 2
    intermediate_size: int = 768
    max_position_embeddings: int = 2048
    corpus: str = "base"  # or the name of the extra documents the tokenizer learns ("search": the search env's)
    build_format: int = BUILD_FORMAT


# ---------------------------------------------------------------------------------------------- corpus

_NAMES = "Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Mallory Niaj Olivia Peggy Rupert Sybil Trent Victor Wendy".split()
_PLACES = ("Paris London Berlin Madrid Rome Tokyo Cairo Lima Oslo Vienna Prague Dublin Lisbon Athens Nairobi Delhi "
           "Seoul Sydney Toronto Chicago Boston Denver France Germany Spain Italy Japan Egypt Peru Norway Austria").split()
_NOUNS = ("river city country capital mountain book paper model agent tool answer question search result number file "
          "function value list table page link button form window house garden road school market bridge lake "
          "forest island station library museum language population area border currency planet star ocean "
          "engine computer program test error message user assistant system document report").split()
_VERBS = ("finds reads writes opens closes computes returns checks searches calls runs builds visits crosses "
          "contains describes explains follows answers clicks types selects saves loads prints lists counts").split()
_ADJS = ("large small old new red blue green quick slow bright dark ancient modern famous quiet busy long short "
         "high low deep wide simple correct wrong final first last next previous main").split()
_COMMON = ("about above across after again against almost alone along already also although always among "
           "another anything around away back because become before began behind being below between both bring "
           "build call came carry cause change children close come could country cover cross current different "
           "during early earth enough even every example family father field figure follow food form found friend "
           "general give group grow hand happen hard head hear heart help however idea important include inside "
           "interest keep kind know land large later learn leave letter life light line little live local long look "
           "made make many mean might mind money month morning mother move much music must name near need never "
           "night nothing notice number often only open order other over paper part people perhaps person picture "
           "place plant point possible power problem produce public question quite rather reach ready real reason "
           "remember rest right room round same science second seem sentence several should show side since small "
           "something sometimes sound space special spring stand start state still story strong study such summer "
           "sure surface table take teacher than thing those though thought through together toward travel tree "
           "true under until usually very voice water weather where whether which while whole without wonder word "
           "work world would write year young yesterday tomorrow history government company research energy "
           "information knowledge education development environment experience relationship technology").split()
_SYLLABLES = ("ka ri to mo na le su vi da ra ne lo mi ta ko sa ve ru di po ba ze fi gu ha je qua sto bre "
              "tor lin mar ven dal gor fen wil hel ost ber cas mon tel vor nix zan").split()
_TOOLS = ["calculator", "search", "python", "bash", "read_file", "write_file", "get_weather", "click", "type_text",
          "open_url", "finish"]
_OPS = ["+", "-", "*", "/"]


def _arith(rng: random.Random) -> tuple[str, str]:
    """A small arithmetic expression and its value, as strings."""
    a, b, c = rng.randint(0, 99), rng.randint(1, 99), rng.randint(0, 999)
    op1, op2 = rng.choice(_OPS), rng.choice(_OPS[:3])
    expr = rng.choice([f"{a} {op1} {b}", f"{c} {op2} ({a} {op1} {b})", f"({a} {op2} {b}) {op1} {c or 1}"])
    value = eval(expr)  # noqa: S307 -- our own generated expression of digits and operators
    return expr, (str(int(value)) if float(value).is_integer() else f"{value:.4g}")


def _pseudo_word(rng: random.Random) -> str:
    """An invented name ("Velkamor"): the generated worlds of search tasks are full of them."""
    return "".join(rng.choices(_SYLLABLES, k=rng.randint(2, 4))).capitalize()


def _prose(rng: random.Random) -> str:
    words = rng.choices(_COMMON + _NOUNS + _ADJS + _VERBS, k=rng.randint(6, 16))
    return " ".join(words).capitalize() + rng.choice([".", ".", "?", "!", ","])


def _fact(rng: random.Random) -> str:
    a, b = _pseudo_word(rng), _pseudo_word(rng)
    return rng.choice([f"{a} is the capital of {b}.", f"The {rng.choice(_NOUNS)} of {a} is {b}.",
                       f"{a} was founded in {rng.randint(800, 2024)} by {rng.choice(_NAMES)} {b}.",
                       f"{a} borders {b} and {_pseudo_word(rng)}; its population is {rng.randint(1000, 9999999)}."])


def _code(rng: random.Random) -> str:
    name, arg = rng.choice(_VERBS).rstrip("s"), rng.choice(_NOUNS)
    expr = _arith(rng)[0]
    return (f"def {name}_{arg}({arg}, n=0):\n    \"\"\"{_prose(rng)}\"\"\"\n    result = {expr}\n"
            f"    if {arg} is None:\n        return [{arg}, n]\n    return {{'{arg}': result + n}}\n")


def _sentence(rng: random.Random) -> str:
    n1, n2 = rng.sample(_NOUNS, 2)
    pattern = rng.randrange(5)
    if pattern == 0:
        return f"The {rng.choice(_ADJS)} {n1} {rng.choice(_VERBS)} the {n2}."
    if pattern == 1:
        return f"{rng.choice(_NAMES)} {rng.choice(_VERBS)} a {rng.choice(_ADJS)} {n1} in {rng.choice(_PLACES)}."
    if pattern == 2:
        return f"What is the {n1} of {rng.choice(_PLACES)}?"
    if pattern == 3:
        return f"{rng.choice(_PLACES)} has {rng.randint(2, 9999)} {n1}s and {rng.randint(1, 99)} {n2}s."
    return f"I think the {n1} is {rng.choice(_ADJS)}, but the {n2} is not."


def _tool_call(rng: random.Random) -> str:
    tool = rng.choice(_TOOLS)
    if tool == "calculator":
        args = {"expression": _arith(rng)[0]}
    elif tool == "search":
        args = {"query": f"{rng.choice(_NOUNS)} of {rng.choice(_PLACES)}"}
    elif tool in ("python", "bash"):
        args = {"code": f"print({_arith(rng)[0]})"} if tool == "python" else {"command": f"ls -la /tmp/{rng.choice(_NOUNS)}"}
    elif tool in ("read_file", "write_file"):
        args = {"path": f"src/{rng.choice(_NOUNS)}.py"}
    else:
        args = {"target": f"{rng.choice(_ADJS)} {rng.choice(_NOUNS)}", "index": rng.randint(0, 20)}
    return "<tool_call>\n" + json.dumps({"name": tool, "arguments": args}) + "\n</tool_call>"


def _chat(rng: random.Random) -> str:
    expr, value = _arith(rng)
    user = rng.choice([f"What is {expr}?", _sentence(rng), f"Compute {expr} and explain."])
    turns = [f"{IM_START}system\nYou are a helpful assistant.{IM_END}", f"{IM_START}user\n{user}{IM_END}"]
    if rng.random() < 0.5:
        turns.append(f"{IM_START}assistant\n{_tool_call(rng)}{IM_END}")
        turns.append(f"{IM_START}user\n<tool_response>\n{value}\n</tool_response>{IM_END}")
    turns.append(f"{IM_START}assistant\nThe answer is <answer>{value}</answer>{IM_END}")
    return "\n".join(turns)


def _react(rng: random.Random) -> str:
    expr, value = _arith(rng)
    place = rng.choice(_PLACES)
    return (f"Question: {_sentence(rng)}\nThought: I need to search for the {rng.choice(_NOUNS)} of {place}.\n"
            f"Action: search\nAction Input: {rng.choice(_NOUNS)} of {place}\nObservation: {_sentence(rng)}\n"
            f"Thought: Now I compute {expr}.\nAction: calculator\nAction Input: {expr}\nObservation: {value}\n"
            f"Thought: I know the final answer.\nFinal Answer: {value}")


def _search_r1(rng: random.Random) -> str:
    place, noun = rng.choice(_PLACES), rng.choice(_NOUNS)
    return (f"<think>I should find the {noun} of {place}.</think>\n<search>{noun} of {place}</search>\n"
            f"<information>Doc 1: {_sentence(rng)} Doc 2: {_sentence(rng)}</information>\n"
            f"<think>The {noun} of {place} is {rng.choice(_NAMES)}.</think>\n<answer>{rng.choice(_NAMES)}</answer>")


def training_corpus(seed: int = 0, num_lines: int = 4000, documents: Sequence[str] = ()) -> Iterator[str]:
    """Deterministic tokenizer training text: `documents` (an env's texts, so that its invented names get tokens of
    their own), then prose, arithmetic, tool calls, ReAct and Search-R1 traces, chats."""
    yield from documents
    rng = random.Random(seed)
    kinds = [_sentence, _prose, _fact, _code, lambda r: " = ".join(_arith(r)), _tool_call, _chat, _react, _search_r1]
    weights = [3, 3, 3, 1, 2, 2, 2, 1, 1]
    for _ in range(num_lines):
        yield rng.choices(kinds, weights)[0](rng)
    yield TEMPLATE_PATH.read_text()  # the tools preamble that every tool-using system prompt contains


# ---------------------------------------------------------------------------------------------- build

def train_tokenizer(settings: TinyModelSettings, documents: Sequence[str] = ()):
    """Byte-level BPE with Qwen2's pre-tokenizer, wrapped as a `PreTrainedTokenizerFast` with a ChatML template."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Exactly Qwen2's pipeline (NFC included): transformers' AutoTokenizer rebuilds a `qwen2` model's tokenizer
    # as `Qwen2Tokenizer` from vocab and merges, so anything else here would differ from what users load.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=settings.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: any text can be encoded
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(settings.seed, documents=documents), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        bos_token=None,
        unk_token=None,
        model_max_length=settings.max_position_embeddings,
        clean_up_tokenization_spaces=False,  # decode(encode(text)) == text for NFC text
        chat_template=TEMPLATE_PATH.read_text(),
    )


def build_model(settings: TinyModelSettings, tokenizer):
    """A randomly initialised Qwen2ForCausalLM (float32) whose vocab is the tokenizer's."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    eos_id, pad_id = tokenizer.convert_tokens_to_ids([IM_END, PAD])
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=settings.hidden_size,
        intermediate_size=settings.intermediate_size,
        num_hidden_layers=settings.num_layers,
        num_attention_heads=settings.num_heads,
        num_key_value_heads=settings.num_kv_heads,
        max_position_embeddings=settings.max_position_embeddings,
        tie_word_embeddings=False,  # vLLM's weight reload breaks with tied embeddings (docs/vllm.md)
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        torch.manual_seed(settings.seed)
        model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id)
    return model


def _save_quietly(model, out_dir: Path) -> None:
    """`save_pretrained` without transformers' own tqdm bar (the build prints its progress with rich)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out_dir)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _corpus_hash(settings: TinyModelSettings, documents: Sequence[str]) -> str:
    """Part of the build record, so that a changed corpus generator (or template) triggers a rebuild."""
    h = hashlib.sha256()
    for line in training_corpus(settings.seed, documents=documents):
        h.update(line.encode() + b"\0")
    return h.hexdigest()


def _build_record(settings: TinyModelSettings, documents: Sequence[str]) -> dict:
    return {"settings": asdict(settings), "corpus_sha256": _corpus_hash(settings, documents)}


def build_tiny_model(out_dir: str | Path, seed: int = 0, *, documents: Sequence[str] = (), force: bool = False,
                     quiet: bool = False, **overrides: int | str) -> Path:
    """Build the tiny model into `out_dir` (created if needed) and return its path.

    `overrides` are `TinyModelSettings` fields (e.g. `hidden_size=128`); with `documents` for the tokenizer to
    learn, `corpus` names them. If `out_dir` already holds a complete build with the same settings and text,
    nothing is rebuilt unless `force`.
    """
    settings = TinyModelSettings(seed=seed, **overrides)
    if (settings.corpus == "base") != (not documents):
        raise ValueError(f"corpus={settings.corpus!r} with {len(documents)} documents: name extra documents "
                         "with corpus (e.g. corpus='search'), and give documents to any corpus but 'base'")
    out_dir = Path(out_dir).expanduser()  # recipes and scripts write "~/.cache/..."
    log = (lambda msg: None) if quiet else _console.print
    record = _build_record(settings, documents)
    if not force and changed_files(out_dir, record) is None:
        log(f"[green]tiny model[/] already built in {out_dir}")
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / BUILD_FILE).unlink(missing_ok=True)  # an interrupted build must not look complete
    with _console.status("training tokenizer...", spinner="dots") if not quiet else nullcontext():
        tokenizer = train_tokenizer(settings, documents)
        tokenizer.save_pretrained(out_dir)
    log(f"tokenizer: {len(tokenizer)} tokens")
    with _console.status("initialising weights...", spinner="dots") if not quiet else nullcontext():
        model = build_model(settings, tokenizer)
        _save_quietly(model, out_dir)
    n_params = sum(p.numel() for p in model.parameters())
    write_record(out_dir, {**record, "num_parameters": n_params})
    log(f"[green]tiny model[/] built in {out_dir}: {n_params / 1e6:.2f} M parameters")
    return out_dir
