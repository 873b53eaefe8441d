"""Shared fixtures. `tiny_model_dir`: the project's tiny CPU model, built once per test session. `smollm2_dir`:
the real SmolLM2-135M-Instruct, fetched into the cache (`make model-smollm2`; a no-op when up to date)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.models.fetch import fetch_model
from agentrl.models.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0, quiet=True)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return fetch_model("smollm2-135m-instruct", quiet=True)
