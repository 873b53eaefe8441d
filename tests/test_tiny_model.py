"""The tiny model builds deterministically, loads in transformers, and has the chat template we render with."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.models.tiny import BUILD_FILE, build_tiny_model
from agentrl.models.tokenizer import load_tokenizer

QWEN2_5_TEMPLATE = Path(__file__).parent / "data" / "chat_templates" / "qwen2_5.jinja"
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 3 * (4 + 5)?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "27"},
    {"role": "tool", "tool_call_id": "call_2", "content": "ok"},
    {"role": "assistant", "content": "<answer>27</answer>"},
]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_build_is_deterministic_and_idempotent(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again", seed=0, quiet=True)
    for name in ("tokenizer.json", "model.safetensors", "config.json", "generation_config.json"):
        assert sha256(again / name) == sha256(tiny_model_dir / name), name

    mtime = (again / "model.safetensors").stat().st_mtime_ns
    build_tiny_model(again, seed=0, quiet=True)  # complete build, same settings: skipped
    assert (again / "model.safetensors").stat().st_mtime_ns == mtime

    with open(again / "model.safetensors", "ab") as f:  # a damaged build is rebuilt
        f.write(b"\0")
    build_tiny_model(again, seed=0, quiet=True)
    assert sha256(again / "model.safetensors") == sha256(tiny_model_dir / "model.safetensors")


def test_search_corpus_gives_train_names_shorter_tokens_and_held_out_names_none_of_their_own(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """The search env's tokenizer documents (the documents training shows) in the tokenizer's text: train entity
    names take fewer tokens; held-out names, in none of that text, stay in the syllable tokens that training uses
    too. It is another build (its own record), not the base model."""
    import agentrl
    from agentrl.envs.search.env import tokenizer_documents

    search_dir = build_tiny_model(tmp_path / "search", seed=0, quiet=True, corpus="search",
                                  documents=tokenizer_documents())
    base, search = AutoTokenizer.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(search_dir)

    def tokens_per_name(tok, split: str) -> float:
        names = [" " + t.data["chain"][0]["query"] for t in agentrl.make("search/r1-v0", split=split).tasks]
        return sum(len(tok.encode(n, add_special_tokens=False)) for n in names) / len(names)

    assert tokens_per_name(search, "train") < 0.6 * tokens_per_name(base, "train")
    assert tokens_per_name(search, "unseen_entities") > 1.2 * tokens_per_name(search, "train")
    assert json.loads((search_dir / BUILD_FILE).read_text())["settings"]["corpus"] == "search"
    with pytest.raises(ValueError, match="name extra documents with corpus"):
        build_tiny_model(tmp_path / "bad", quiet=True, corpus="web")  # a name without its documents
    with pytest.raises(ValueError, match="name extra documents with corpus"):
        build_tiny_model(tmp_path / "bad", quiet=True, documents=["text"])  # documents without a name


def test_build_record(tiny_model_dir: Path) -> None:
    record = json.loads((tiny_model_dir / BUILD_FILE).read_text())
    assert record["settings"]["seed"] == 0 and record["settings"]["hidden_size"] == 256
    assert 3_000_000 < record["num_parameters"] < 10_000_000
    assert record["files"]["model.safetensors"] == sha256(tiny_model_dir / "model.safetensors")


def test_loads_in_transformers_with_vllm_compatible_config(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = model.config
    assert config.model_type == "qwen2" and model.dtype == torch.float32
    assert config.tie_word_embeddings is False  # vLLM's weight reload needs untied embeddings
    assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    assert config.hidden_size // config.num_attention_heads == 64  # vLLM CPU attention refuses head_dim 16
    assert getattr(config, "head_dim", None) in (None, 64)
    assert config.vocab_size == len(tok) > 3500
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    assert model.generation_config.eos_token_id == tok.eos_token_id == config.eos_token_id
    logits = model(torch.tensor([tok.encode("Hello")])).logits
    assert logits.shape[-1] == len(tok)


@pytest.mark.parametrize("text", [
    "The quick brown fox. 12 * (34 + 5) = 468",
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}\n</tool_call>',
    "Thought: search\nAction: search\nAction Input: capital of Velkamor\n\n  trailing  ",
    "<search>Oslo</search> <answer>42</answer> wörld ünïcode 日本語 🙂 \t tabs",
])
def test_tokenizer_round_trips(tiny_model_dir: Path, text: str) -> None:
    tok = load_tokenizer(tiny_model_dir)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok.encode("1234", add_special_tokens=False)) == ["1", "2", "3", "4"]
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert len(tok.encode(special, add_special_tokens=False)) == 1


def test_chat_template_renders_a_tool_conversation(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert text.endswith(
        "<|im_start|>user\nWhat is 3 * (4 + 5)?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n27\n</tool_response>\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<answer>27</answer><|im_end|>\n")
    # No default system prompt: without system message and tools there is no system turn.
    plain = tok.apply_chat_template(CONVERSATION[1:2], tokenize=False, add_generation_prompt=True)
    assert plain == "<|im_start|>user\nWhat is 3 * (4 + 5)?<|im_end|>\n<|im_start|>assistant\n"
    tools_only = tok.apply_chat_template(CONVERSATION[1:2], tools=TOOLS, tokenize=False)
    assert tools_only.startswith("<|im_start|>system\n# Tools\n\n")


def test_chat_template_matches_qwen2_5_when_a_system_message_is_given(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    qwen = QWEN2_5_TEMPLATE.read_text()
    for tools in (None, TOOLS):
        for end in range(1, len(CONVERSATION) + 1):
            messages = CONVERSATION[:end]
            ours = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
            theirs = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                             chat_template=qwen)
            assert ours == theirs


def test_load_tokenizer_says_how_to_build(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="agentrl model init"):
        load_tokenizer(tmp_path / "missing")
