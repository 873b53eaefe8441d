"""The loop's rank-dependent steps (`Sharding`): with the trainer sharded over torchrun's ranks (FSDP2,
`trainers/fsdp.py`), rank 0 alone samples, evaluates, logs and writes, and every rank takes part in each weight
sync and checkpoint; in one process each step is the plain call."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import AutoModelForCausalLM

from agentrl.policy.parity import end_trainer_logprobs, follow_trainer_logprobs
from agentrl.policy.protocol import Policy
from agentrl.trainers.checkpoint import save_checkpoint
from agentrl.trainers.fsdp import broadcast, data_parallel, full_optimizer_state, gather_into


class Sharding:
    """The loop's rank-dependent steps in one place. In one process each is the plain call. With the trainer
    sharded over ranks (`trainers/fsdp.py`), rank 0 alone samples, evaluates, logs and writes checkpoints: it
    broadcasts each step's rollouts and every rank trains on its share (`policy` is None on the other ranks).
    A sync into vLLM by transfer streams the weights from every rank's shards (`weight_transfer`) and runs its
    parity forwards on every rank; any other sync (the in-process sampler, a checkpoint) gathers the full weights
    into rank 0's plain copy first, as checkpoints do."""

    def __init__(self, model: torch.nn.Module, policy: Policy | None):
        self.rank, self.world = data_parallel()
        self.model, self.policy, self.main = model, policy, self.rank == 0
        # rank 0's unsharded copy: the sampler's own model when in-process, else one to export from
        self.plain = ((getattr(policy, "model", None) or AutoModelForCausalLM.from_config(model.config))
                      if self.world > 1 and self.main else None)
        spec = self.from_main(lambda: _transfer_for_ranks(policy, model)) if self.world > 1 else None
        self.streams, self.follower = spec is not None, None  # syncs streamed from every rank's shards
        if self.streams and not self.main:  # this rank's part of each sync (rank 0's is the policy's own)
            from agentrl.policy.weight_transfer import open_transfer  # imports vLLM

            self.follower = open_transfer(spec[0], None, model, None, None, 0, dtype=spec[1], rank=self.rank)

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
                gather_into(self.model, self.plain)  # every rank takes part
            if self.main:
                asyncio.run(self.policy.sync_weights(self.plain or self.model, version))
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
            gather_into(self.model, self.plain)
        if self.main:
            save_checkpoint(out_dir, step, self.plain or self.model, tokenizer, state=state,
                            optimizer_state=optimizer_state, submodels=submodels)


def _transfer_for_ranks(policy: Policy, model: torch.nn.Module) -> tuple[str, Any] | None:
    """How the other ranks join rank 0's syncs by transfer (`VLLMPolicy.transfer_for_ranks`); None: they do not."""
    return for_ranks(model) if (for_ranks := getattr(policy, "transfer_for_ranks", None)) else None
