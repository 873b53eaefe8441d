"""The policy protocol: token ids in, sampled token ids and their logprobs out.

Two backends implement it: in-process transformers (`agentrl.policy.hf.HFPolicy`) and a vLLM server
(CPU or GPU). The rollout engine only sees this protocol, so the backends are interchangeable.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

from pydantic import with_config

from agentrl.config import STRICT
from agentrl.types import FinishReason

# Seeds the engines accept: vLLM and torch take a signed 64-bit seed, and sample i of a request draws seed + i. A
# larger one fails the engine's whole batch, the other requests in it included.
MAX_SEED = 2**63 - 1 - 64


# The episode a `generate` call belongs to, set by the rollout engine for each episode's asyncio task: a
# router of several engines keeps an episode on one engine with it (`agentrl.policy.router`).
current_episode: ContextVar[str | None] = ContextVar("agentrl_current_episode", default=None)


class PolicyError(RuntimeError):
    """The policy backend failed (server down, bad request). The episode ends with status `error`."""


@with_config(STRICT)
@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    n: int = 1  # samples per request
    seed: int | None = None  # makes a request reproducible whatever else is batched with it
    stop: tuple[str, ...] = ()  # stop strings; the matched string is kept in the sampled ids
    stop_token_ids: tuple[int, ...] = ()  # besides the model's EOS; the stop token is kept

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, {MAX_SEED}], got {self.seed}")


@dataclass(frozen=True)
class Sample:
    """One completion. `logprobs[i]` is the model's log-probability of `token_ids[i]` at temperature 1
    (the raw distribution, as the trainer computes it), not of the tempered sampling distribution."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    # Per token, 1 if the trained policy wrote it. Empty: all of them. Tandem rollouts set 0 on the tokens
    # of the frozen partner, which then keep loss mask 0 like observations (`agentrl.trainers.methods.tandem`).
    trainable: tuple[int, ...] = ()
    # The weights that sampled it, when a wrapper knows (`agentrl.rollout.source.VersionGate`); else the
    # engine takes the policy's `weight_version`.
    weight_version: int | None = None


@runtime_checkable
class Policy(Protocol):
    """A sampling backend: what the rollout engine calls to continue a prompt."""

    weight_version: int  # bumped by each sync; trajectories record the version that sampled them

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> list[Sample]:
        """Return `sampling.n` samples continuing `prompt_ids`."""
        ...

    async def sync_weights(self, model: Any, version: int) -> None:
        """Make the engine sample from `model`'s current weights (a transformers causal LM), as `version`."""
        ...

    async def close(self) -> None:
        """Release the backend (worker, server, connections); no calls after it."""
        ...
