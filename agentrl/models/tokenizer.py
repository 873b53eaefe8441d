"""Loading a model's tokenizer, with an error that says how to get one, and the chat templates the project ships.

A model's own chat template is used unless a job names another (`chat_template = "chatml-tools"`, or a path to a
Jinja file). `chatml-tools` is the project's addition, not a model's: ChatML with tools as Qwen2.5 and Hermes write
them (the schemas in the system turn, `<tool_call>` JSON in the assistant turn, results in `<tool_response>`
blocks of a user turn), for ChatML models whose own template has no tools, such as SmolLM2's.
"""

from __future__ import annotations

import os
from pathlib import Path

CHAT_TEMPLATES = {"chatml-tools": Path(__file__).parent / "templates" / "chatml_tools.jinja"}


def chat_template_text(name_or_path: str) -> str:
    """The Jinja text of a shipped template (`CHAT_TEMPLATES`) or of a template file."""
    path = CHAT_TEMPLATES.get(name_or_path) or Path(os.path.expanduser(name_or_path))
    if not path.is_file():
        raise ValueError(f"chat_template {name_or_path!r} is neither a shipped template "
                                f"({', '.join(CHAT_TEMPLATES)}) nor a Jinja file")
    return path.read_text()


def load_tokenizer(model_dir_or_name: str | Path, chat_template: str | None = None):
    """`AutoTokenizer.from_pretrained`, with an error that says how to get the tiny model; with `chat_template`
    (a name of `CHAT_TEMPLATES` or a Jinja file) in place of the model's own."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(str(model_dir_or_name)))
    except (OSError, ValueError) as e:
        raise FileNotFoundError(
            f"No tokenizer at {model_dir_or_name!r}: {e}\n"
            f"Build the tiny CPU model with `agentrl model init {model_dir_or_name}`, fetch a real one with "
            "`agentrl model fetch smollm2-135m-instruct`, or pass a local model directory / hub name that has a "
            "tokenizer."
        ) from e
    if chat_template is not None:
        tokenizer.chat_template = chat_template_text(chat_template)
    return tokenizer
