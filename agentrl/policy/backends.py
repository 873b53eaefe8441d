"""Choosing the policy engine for a job: in-process transformers, or vLLM (started here or attached by URL)."""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from typing import Literal, Sequence

from pydantic import with_config

from agentrl.config import STRICT
from agentrl.policy.protocol import Policy
from agentrl.policy.vllm_server import ServerConfig


@with_config(STRICT)
@dataclass(frozen=True)
class EngineConfig(ServerConfig):
    """`[engine]`: which engine samples, and for vLLM how its server starts (`ServerConfig`'s settings: device,
    max_model_len, dtype, weight_transfer, gpus, ...) or where it runs (`url`), and how each sync is checked."""

    kind: Literal["transformers", "vllm"] = "transformers"
    url: str | None = None  # vllm: attach to a running server instead of starting one
    # vllm: servers started, each episode kept on one of them (agentrl.policy.router), every sync sent to all. On
    # GPU, `gpus` lists replicas × tensor_parallel_size devices, taken in order ("0,1,2,3", 2 × 2: "0,1" and "2,3")
    replicas: int = 1
    # vllm, after each sync: the largest mean |logp_engine - logp_trainer| in nats on the sampled tokens, and on each
    # kind it did not sample (prompt, probe text, top-k). None: by the served dtype (float32 1e-3 and 1e-3;
    # bf16/fp16, and "auto" on GPU, 5e-2 and 0.25)
    parity_mean_threshold: float | None = None
    parity_unsampled_mean_threshold: float | None = None
    parity_tail_nats: float = 2.0  # vllm: a token this far off (nats) counts as a broken sync, not kernel noise
    parity_tail_share: float = 0.01  # vllm: the largest share of the tokens over parity_tail_nats

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model:
            raise ValueError("engine.model: the engine serves the job's model; set `model` at the top of the recipe")
        if self.url and self.kind != "vllm":
            raise ValueError("engine.url attaches to a vLLM server: set engine.kind = 'vllm'")
        if self.sleep_mode and (self.kind != "vllm" or self.device != "gpu"):
            raise ValueError("engine.sleep_mode is vLLM's on GPU (kind = 'vllm', device = 'gpu'): remove it")
        started = {"gpus": self.gpus, "tensor_parallel_size": self.tensor_parallel_size != 1,
                   "gpu_memory_utilization": self.gpu_memory_utilization, "lora_rank": self.lora_rank}
        if self.replicas < 1 or self.replicas > 1 and (self.kind != "vllm" or self.url):
            raise ValueError(f"engine.replicas = {self.replicas}: replicas are vLLM servers started by the job "
                             "(kind = 'vllm', no url), at least 1. To route over servers started elsewhere, build "
                             "agentrl.policy.router.RoutedPolicy over VLLMPolicy.attach(url) for each "
                             "(docs/scaling.md)")
        if self.device == "gpu" and (self.replicas > 1 or self.gpus is not None):
            devices = [d.strip() for d in (self.gpus or "").split(",") if d.strip()]
            if not all(d.isdigit() for d in devices) or len(devices) != self.replicas * self.tensor_parallel_size:
                raise ValueError(f"engine.replicas = {self.replicas} on GPU needs gpus to list replicas × "
                                 f"tensor_parallel_size = {self.replicas * self.tensor_parallel_size} device indices, "
                                 f"one group per server in order (e.g. gpus = \"0,1\" for 2 × 1), got {self.gpus!r}")
        if self.url and any(v for v in started.values()):
            raise ValueError(f"engine.url attaches to a running server, so {[k for k, v in started.items() if v]} "
                             "cannot apply: set them where the server is started (`agentrl serve policy`)")

    def replica_gpus(self) -> list[str | None]:
        """Each started server's CUDA_VISIBLE_DEVICES: `gpus` split into `replicas` groups (on GPU), else as is."""
        if self.replicas == 1 or self.device != "gpu":
            return [self.gpus] * self.replicas
        devices, size = [d.strip() for d in self.gpus.split(",") if d.strip()], self.tensor_parallel_size
        return [",".join(devices[i * size:(i + 1) * size]) for i in range(self.replicas)]


def open_policy(model: str, engine: EngineConfig, parity_prompts: Sequence[Sequence[int]] = (),
                parity_probe: Sequence[int] = (), adapters: int = 0) -> Policy:
    """A policy serving `model`. A vLLM server started here is stopped by the policy's `close()`; several
    (`engine.replicas`) start together and serve behind a `RoutedPolicy`. With `parity_prompts`, every weight sync
    into vLLM is checked against the trainer's logprobs on them and on `parity_probe` (`PROBE_TEXT`'s ids).
    `adapters` > 0: a LoRA model syncs its adapter alone into vLLM, which keeps that many versions (`VLLMPolicy`)."""
    model = os.path.expanduser(model)
    if engine.kind == "transformers":
        from agentrl.policy.hf import HFPolicy

        return HFPolicy.load(model)
    from agentrl.policy.parity import ParityCheck, mean_thresholds_for
    from agentrl.policy.vllm_client import VLLMPolicy

    served = engine.dtype or ("float32" if engine.device == "cpu" else "auto")  # as `server_command` resolves it
    sampled, unsampled = mean_thresholds_for(served)
    parity = ParityCheck(
        prompts=tuple(tuple(p) for p in parity_prompts), probe=tuple(parity_probe),
        mean_threshold=sampled if engine.parity_mean_threshold is None else engine.parity_mean_threshold,
        unsampled_mean_threshold=(unsampled if engine.parity_unsampled_mean_threshold is None
                                  else engine.parity_unsampled_mean_threshold),
        tail_nats=engine.parity_tail_nats, tail_share=engine.parity_tail_share) if parity_prompts else None
    if engine.url:
        return VLLMPolicy.attach(engine.url, parity=parity, weight_transfer=engine.weight_transfer,
                                 sleep_mode=engine.sleep_mode, adapters=adapters)
    server = ServerConfig(**{f.name: getattr(engine, f.name) for f in fields(ServerConfig)})  # its own part
    servers = [replace(server, model=model, gpus=gpus) for gpus in engine.replica_gpus()]
    if len(servers) == 1:
        return VLLMPolicy.start(servers[0], progress=True, parity=parity, adapters=adapters)
    from agentrl.policy.router import RoutedPolicy

    with ThreadPoolExecutor(len(servers)) as pool:  # they start together; the first one's progress is shown
        starts = [pool.submit(VLLMPolicy.start, server, progress=i == 0, parity=parity, adapters=adapters)
                  for i, server in enumerate(servers)]
    if failed := [f.exception() for f in starts if f.exception() is not None]:
        for started in (f.result() for f in starts if f.exception() is None):
            asyncio.run(started.close())
        raise failed[0]
    return RoutedPolicy([f.result() for f in starts])
