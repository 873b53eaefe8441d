"""Loading a model's tokenizer, with an error that says how to get one."""

from __future__ import annotations

import os
from pathlib import Path


def load_tokenizer(model_dir_or_name: str | Path):
    """`AutoTokenizer.from_pretrained`, with an error that says how to get the tiny model."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(os.path.expanduser(str(model_dir_or_name)))
    except (OSError, ValueError) as e:
        raise FileNotFoundError(
            f"No tokenizer at {model_dir_or_name!r}: {e}\n"
            f"Build the tiny CPU model with `agentrl model init {model_dir_or_name}`, or pass a local model "
            "directory / hub name that has a tokenizer."
        ) from e
