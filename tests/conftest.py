"""Shared fixtures. `tiny_model_dir`: the project's tiny CPU model, built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.models.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0, quiet=True)
