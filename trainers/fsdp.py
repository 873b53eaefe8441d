"""The trainer sharded across processes with torch FSDP2 (`fully_shard`): each rank holds 1/world of every
parameter, gradient and optimizer state, and trains on its share of each minibatch.

    rank, world = init()                      # under torchrun (or any launcher that sets RANK/WORLD_SIZE)
    shard(model)                              # every decoder layer its own unit, the root the rest
    optimizer = torch.optim.AdamW(model.parameters())   # made after shard(): it holds the shards
    grpo.update(model, ...)                   # each rank: rows[rank::world] of every minibatch
    state = full_state_dict(model)            # every rank calls; rank 0 gets full CPU tensors, for the
                                              # engine's weight sync and for checkpoints

Sharding the data is gradient accumulation across processes: `grpo.optimize` weighs each rank's part by its
share of the minibatch's tokens (`losses.micro_batch_weight`) times `world`, because FSDP averages the
gradients of the ranks; so the step equals the single-process step on the whole minibatch, whatever the
loss aggregation. Gloo on CPU (tests), NCCL on GPUs.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


def data_parallel() -> tuple[int, int]:
    """(rank, world size) of this process: (0, 1) outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init(backend: str | None = None) -> tuple[int, int]:
    """Joins the process group that torchrun describes in the environment; NCCL with GPUs, else gloo."""
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return data_parallel()


def shard(model: torch.nn.Module, reshard_after_forward: bool = True) -> torch.nn.Module:
    """FSDP2 on a transformers causal LM (or its critic): each decoder layer is one unit, the root holds the
    embeddings, the final norm and the head (tied embeddings must share a unit, and do)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    layers = getattr(getattr(model, model.base_model_prefix, model), "layers", None)
    if layers is None:
        raise ValueError(f"shard() needs a model with decoder layers at .{model.base_model_prefix}.layers; "
                         f"{type(model).__name__} has none")
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full parameters, gathered: a collective (every rank calls it); rank 0 gets them as CPU tensors,
    the other ranks an empty dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def broadcast(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (e.g. the batch that rank 0's rollouts produced)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
