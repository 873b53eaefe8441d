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

Every rank-dependent step of training is here: the loop's (`Sharding`: rank 0 alone samples, evaluates, logs and
writes; every rank takes part in each weight sync and checkpoint) and resuming from a checkpoint (`resume`: rank 0
reads, every rank gets its shards). In one process each is the plain call.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import types
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from agentrl.policy.logprobs import SHARDED_FORWARD, masked_logprobs
from agentrl.policy.parity import end_trainer_logprobs, follow_trainer_logprobs
from agentrl.policy.precision import compute_dtype, mixed_precision
from agentrl.policy.protocol import Policy
from agentrl.trainers.checkpoint import (CheckpointError, finished_checkpoints, load_model, read_weights,
                                         save_checkpoint, set_rng_state, trainer_state)

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """Where this process stands: the only one (rank 0 of 1), or rank `rank` of `world` under torchrun."""

    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        """Rank 0: the one that samples, evaluates, logs and writes."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """Whether the trainer is sharded over several ranks."""
        return self.world > 1

    def share(self, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
        """This rank's rows of a forward pass cut for every rank (`rows[rank::world]`) and the weight of their loss
        (`world`: FSDP averages the ranks' gradients). A rank left without rows runs the first one at weight 0:
        FSDP's collectives need every rank."""
        return (rows[self.rank::self.world], self.world) if len(rows) > self.rank else (rows[:1], 0)


def current() -> Ranks:
    """This process's place in the process group (the only one outside a process group)."""
    return Ranks(*data_parallel())


def join() -> Ranks:
    """This process's place, after joining torchrun's process group when a launcher started several (`init`)."""
    return Ranks(*init()) if launched() else Ranks()


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


def derived_model(model: torch.nn.Module, build: Callable[[dict[str, torch.Tensor]], torch.nn.Module]) -> torch.nn.Module:
    """A model made from `model`'s weights by `build(state)` (e.g. a critic on the policy's transformer). Sharded,
    rank 0 builds it from the gathered full weights, the other ranks on the meta device from no weights, and it is
    sharded like the policy from rank 0's copy (`full_state_dict` is a collective: every rank calls this)."""
    ranks = current()
    if not ranks.sharded:
        return build(model.state_dict())
    full = full_state_dict(model)
    with torch.device("meta") if not ranks.main else contextlib.nullcontext():
        derived = build(full)
    return shard_from_rank0(derived, next(model.parameters()).device)


def unsharded_copy(model: torch.nn.Module, auto_class: Any) -> torch.nn.Module | None:
    """Rank 0's empty unsharded copy of a sharded `model` (made with `auto_class`), which checkpoints gather into;
    None elsewhere, and in one process (the model is whole)."""
    ranks = current()
    dtype = next(model.parameters()).dtype
    return auto_class.from_config(model.config, dtype=dtype) if ranks.sharded and ranks.main else None


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


def agreed(read: Callable[[], T]) -> T:
    """`read()`; in a sharded run, a `CheckpointError` on any rank is raised on every rank, so that all of them pass
    over a damaged checkpoint together (one rank falling back alone would leave the others in a collective)."""
    try:
        result, error = read(), None
    except CheckpointError as e:
        result, error = None, str(e)
    if data_parallel()[1] > 1:
        errors: list[str | None] = [None] * data_parallel()[1]
        torch.distributed.all_gather_object(errors, error)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise CheckpointError(error)
    return result


def restore(model: Any, optimizer: torch.optim.Optimizer, path: Path, optimizer_state: dict[str, Any],
            auto_class: Any) -> None:
    """The weights saved at `path` and `optimizer_state` into a live model and its optimizer. A model sharded
    with FSDP gets rank 0's full weights (loaded with `auto_class`) and optimizer state scattered to every
    rank's shards."""
    rank, world = data_parallel()
    if world == 1:
        load_model(model, path)
        optimizer.load_state_dict(optimizer_state)
        return
    load_full_state_dict(model, agreed(lambda: read_weights(auto_class, path) if rank == 0 else {}))
    load_optimizer_state(model, optimizer, optimizer_state if rank == 0 else {})


def resume(model: Any, optimizer: torch.optim.Optimizer, out_dir: Path,
           restore_more: Callable[[Path, dict[str, Any]], None] = lambda checkpoint, state: None
           ) -> dict[str, Any] | None:
    """Restores the model, optimizer and RNGs in place (and, with `restore_more(checkpoint, state)`, what a method
    saved beyond them) from the latest checkpoint in `out_dir` that reads back whole; returns {"step", "state"},
    or None when there is no checkpoint. A damaged one is passed over for the one before, with a warning naming
    both; when every one is damaged, a `CheckpointError`."""
    damaged: list[str] = []
    for checkpoint in reversed(finished_checkpoints(out_dir)):
        try:
            resumed = resume_from(model, optimizer, checkpoint, restore_more)
        except CheckpointError as e:
            damaged.append(str(e))
            continue
        for reason in damaged:
            warnings.warn(f"{reason}; resuming from the previous checkpoint, {checkpoint}", RuntimeWarning)
        return resumed
    if damaged:
        raise CheckpointError("no checkpoint reads back: " + "; ".join(damaged)
                              + ". Delete the checkpoints folder to start over.")
    return None


def resume_from(model: Any, optimizer: torch.optim.Optimizer, checkpoint: Path,
                restore_more: Callable[[Path, dict[str, Any]], None]) -> dict[str, Any]:
    """`resume` from this `checkpoint`."""
    saved = agreed(lambda: trainer_state(checkpoint))
    restore(model, optimizer, checkpoint, saved["optimizer"], AutoModelForCausalLM)
    restore_more(checkpoint, saved["state"])
    set_rng_state(saved["rng"])
    return {"step": saved["step"], "state": saved["state"]}


class Sharding:
    """The loop's rank-dependent steps in one place. In one process each is the plain call. With the trainer
    sharded over ranks, rank 0 alone samples, evaluates, logs and writes checkpoints: it
    broadcasts each step's rollouts and every rank trains on its share (`policy` is None on the other ranks).
    A sync into vLLM by transfer streams the weights from every rank's shards (`weight_transfer`) and runs its
    parity forwards on every rank; any other sync (the in-process sampler, a checkpoint) gathers the full weights
    into rank 0's plain copy first, as checkpoints do."""

    def __init__(self, model: torch.nn.Module, policy: Policy | None):
        self.rank, self.world = data_parallel()
        self.model, self.policy, self.main = model, policy, self.rank == 0
        # rank 0's unsharded copy: the sampler's own model when in-process, else one to export from
        self.unsharded = ((getattr(policy, "model", None) or AutoModelForCausalLM.from_config(model.config))
                      if self.world > 1 and self.main else None)
        spec = self.from_main(lambda: _transfer_for_ranks(policy, model)) if self.world > 1 else None
        self.streams, self.follower = spec is not None, None  # syncs streamed from every rank's shards
        if self.streams and not self.main:  # this rank's part of each sync (rank 0's is the policy's own)
            from agentrl.policy.weight_transfer import open_transfer  # imports vLLM

            self.follower = open_transfer(spec[0], None, model, None, None, 0, dtype=spec[1], rank=self.rank)

    @property
    def sharded(self) -> bool:
        """Whether the trainer is sharded over several ranks."""
        return self.world > 1

    def from_main(self, fn: Callable[[], Any]) -> Any:
        """`fn()` run on rank 0, its result on every rank."""
        return fn() if self.world == 1 else broadcast(fn() if self.main else None)

    def release_engine(self) -> None:
        """The rollouts are in and the trainer steps next: an engine in sleep mode frees its memory meanwhile
        (`VLLMPolicy.release_memory`; the next sync wakes it)."""
        if self.main and (release := getattr(self.policy, "release_memory", None)) is not None:
            asyncio.run(release())

    def sync(self, version: int) -> None:
        """The policy's weights, as version `version`, into the engine."""
        if not self.streams:
            if self.world > 1:
                gather_into(self.model, self.unsharded)  # every rank takes part
            if self.main:
                asyncio.run(self.policy.sync_weights(self.unsharded or self.model, version))
        elif self.main:  # the other ranks gather each tensor with it, then run its parity forwards
            # A failed sync raises here and ends the job (torchrun then stops the other ranks): telling them to
            # stop instead could meet them in another collective.
            asyncio.run(self.policy.sync_weights(self.model, version))
            end_trainer_logprobs()
        else:
            self.follower.send_weights()
            follow_trainer_logprobs(self.model)

    def gathered(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, plain: torch.nn.Module | None
                 ) -> tuple[torch.nn.Module, dict]:
        """(model, optimizer state) as a checkpoint saves them: when sharded, gathered into rank 0's `plain` copy
        (a collective: every rank calls it)."""
        if self.world == 1:
            return model, optimizer.state_dict()
        state = full_optimizer_state(model, optimizer)
        gather_into(model, plain)
        return plain, state

    def save_checkpoint(self, out_dir: Path, step: int, tokenizer: Any, optimizer: torch.optim.Optimizer,
                        state: dict, submodels: dict) -> None:
        """The policy as the last `sync` left it, its optimizer, `state` and `submodels` as checkpoint `step`,
        written by rank 0 (the optimizer state gathered first when sharded: a collective)."""
        optimizer_state = optimizer.state_dict() if self.world == 1 else full_optimizer_state(self.model, optimizer)
        if self.streams:  # streamed syncs leave rank 0's copy as it was
            gather_into(self.model, self.unsharded)
        if self.main:
            save_checkpoint(out_dir, step, self.unsharded or self.model, tokenizer, state=state,
                            optimizer_state=optimizer_state, submodels=submodels)


def _transfer_for_ranks(policy: Policy, model: torch.nn.Module) -> tuple[str, Any] | None:
    """How the other ranks join rank 0's syncs by transfer (`VLLMPolicy.transfer_for_ranks`); None: they do not."""
    return for_ranks(model) if (for_ranks := getattr(policy, "transfer_for_ranks", None)) else None
