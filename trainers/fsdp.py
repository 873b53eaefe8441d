"""The trainer sharded across processes with torch FSDP2 (`fully_shard`): each rank holds 1/world of every
parameter, gradient and optimizer state, and trains on its share of each minibatch.

    rank, world = init()                      # under torchrun (or any launcher that sets RANK/WORLD_SIZE)
    shard(model)                              # every decoder layer its own unit, the root the rest; a model
                                              # marked for mixed precision computes in bf16, reduces in fp32
    optimizer = torch.optim.AdamW(model.parameters())   # made after shard(): it holds the shards
    loop.update(model, ...)                   # each rank: rows[rank::world] of every minibatch
    state = full_state_dict(model)            # every rank calls; rank 0 gets full CPU tensors, for the
                                              # engine's weight sync and for checkpoints

Sharding the data is gradient accumulation across processes: `loop.optimize` weighs each rank's part by its
share of the minibatch's tokens (`losses.micro_batch_weight`) times `world`, because FSDP averages the
gradients of the ranks; so the step equals the single-process step on the whole minibatch, whatever the
loss aggregation. Gloo on CPU (tests), NCCL on GPUs.
"""

from __future__ import annotations

import copy
import os
import types
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from agentrl.policy.logprobs import SHARDED_FORWARD, masked_logprobs
from agentrl.policy.precision import compute_dtype, mixed_precision


def data_parallel() -> tuple[int, int]:
    """(rank, world size) of this process: (0, 1) outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def launched() -> bool:
    """Whether a launcher (torchrun) started this process as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init(backend: str | None = None) -> tuple[int, int]:
    """Joins the process group that torchrun describes in the environment; NCCL with GPUs, else gloo. The
    timeout is long: the other ranks wait in a collective while rank 0 evaluates."""
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend, timeout=timedelta(hours=2))
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return data_parallel()


def shard(model: torch.nn.Module, reshard_after_forward: bool = True) -> torch.nn.Module:
    """FSDP2 on a transformers causal LM (or its critic): each decoder layer is one unit, the root holds the
    embeddings, the final norm and the head (tied embeddings must share a unit, and do).

    A model marked for mixed precision (`agentrl.policy.precision`) keeps its float32 parameters as the shards
    (AdamW's master weights); each unit's forward gathers them cast to the compute dtype, and gradients are
    reduce-scattered in float32, as the single-process step sums them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    layers = getattr(getattr(model, model.base_model_prefix, model), "layers", None)
    if layers is None:
        raise ValueError(f"shard() needs a model with decoder layers at .{model.base_model_prefix}.layers; "
                         f"{type(model).__name__} has none")
    dtype = compute_dtype(model)
    mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    # The masked logprobs (the head on sampled tokens only, in chunks; rows packed when that saves work) as a
    # forward of the root, which gathers the embeddings and the head around it; no shared prefix, whose two passes
    # would gather each layer twice on some ranks and once on others.
    setattr(model, SHARDED_FORWARD, types.MethodType(
        lambda self, *args: masked_logprobs(self, *args, share_prefix=False), model))
    register_fsdp_forward_method(model, SHARDED_FORWARD)
    return model


def from_pretrained(path: str, dtype: torch.dtype, compute: torch.dtype | None,
                    device: torch.device | str) -> torch.nn.Module:
    """The causal LM at `path` in `dtype` (mixed precision in `compute`, if given), sharded (a collective): only rank
    0 reads the weights (`shard_from_rank0`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if dist.get_rank() == 0:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    return shard_from_rank0(mixed_precision(model, compute), device)


def shard_from_rank0(model: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """Shards `model` (a collective) when only rank 0's has its weights, on `device`: the other ranks pass the same
    architecture built on the meta device and receive their shards and buffers from rank 0. So a job holds one full
    copy of the model while it starts, not one per rank (nor spends each rank's time initializing one)."""
    rank = dist.get_rank()
    full = model.state_dict() if rank == 0 else {}  # rank 0's full tensors outlive the sharding, until sent
    shard(model)
    if rank:
        model.to_empty(device=device)
    load_full_state_dict(model, full)
    with torch.no_grad():
        for buffer in model.buffers():  # non-persistent ones (rotary frequencies) are in no state dict
            dist.broadcast(buffer, src=0)
    return model


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of `model` (a reference policy), in eval mode. A sharded model cannot be deep-copied, so its copy
    is built on the meta device, sharded the same way, and each rank copies its own shards and buffers: no rank
    ever holds the full weights."""
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoModelForCausalLM

    if not isinstance(model, FSDPModule):
        return copy.deepcopy(model).eval().requires_grad_(False)
    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(model.config, dtype=next(model.parameters()).dtype)
    shard(mixed_precision(ref, compute_dtype(model)))
    ref.to_empty(device=next(model.parameters()).device)
    with torch.no_grad():
        params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
        for name, p in ref.named_parameters():
            p.to_local().copy_(params[name].to_local())
        for name, b in ref.named_buffers():  # e.g. rotary frequencies, which `to_empty` left uninitialized
            b.copy_(buffers[name])
    return ref.eval().requires_grad_(False)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full parameters, gathered: a collective (every rank calls it); rank 0 gets them as CPU tensors,
    the other ranks an empty dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def gather_into(model: torch.nn.Module, plain: torch.nn.Module | None) -> None:
    """The full weights of the sharded `model` into rank 0's unsharded copy `plain` (a collective; the other
    ranks pass None)."""
    state = full_state_dict(model)
    if plain is not None:
        plain.load_state_dict(state)


def broadcast(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (e.g. the batch that rank 0's rollouts produced)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def load_full_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Loads rank 0's full `state` into the shards of every rank (a collective; other ranks pass {})."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state gathered whole on rank 0, for checkpoints (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Rank 0's full optimizer `state` into every rank's shards (a collective; other ranks pass {})."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
