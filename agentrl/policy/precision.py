"""Mixed precision: float32 master weights, forwards computed in bfloat16 under `torch.autocast`.

AdamW on bfloat16 parameters loses small updates: a weight of ~0.02 has a bf16 half-spacing of ~6e-5, so a
step of lr = 1e-6 rounds away every time (20 steps change about 1 % of such weights, and no norm weight near 1;
tests/test_precision.py). So the trainer keeps float32 parameters and AdamW states, and runs every forward of
the model (the loss, the reference's and the critic's, and the in-process sampler's that shares it) under
autocast: the matmuls read round_bf16(W), which is what a bf16 engine loads from the exported weights too.

    mixed_precision(model, torch.bfloat16)   # marks the model; its parameters stay float32
    with autocast(model):                    # around each forward of it; a no-op on an unmarked model
        logp_BT, _ = token_logprobs(model, ...)

The mark is a plain attribute, so `copy.deepcopy` (reference models) and FSDP2's `fully_shard` keep it.
"""

from __future__ import annotations

import contextlib

import torch

_ATTRIBUTE = "agentrl_compute_dtype"


def mixed_precision(model: torch.nn.Module, dtype: torch.dtype | None) -> torch.nn.Module:
    """Marks `model` to compute in `dtype` under autocast (None: unmark); returns it. Its parameters are left
    as they are: float32 ones are the master weights."""
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"autocast computes in bfloat16 or float16, not {dtype}")
    setattr(model, _ATTRIBUTE, dtype)
    return model


def compute_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype `model`'s forwards compute in under `autocast`, or None when it is not marked."""
    return getattr(model, _ATTRIBUTE, None)


def autocast(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """`torch.autocast` in `model`'s compute dtype on its device, or a context that does nothing when the model
    is not marked (its parameters' dtype is then the compute dtype)."""
    dtype = compute_dtype(model)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(next(model.parameters()).device.type, dtype=dtype)
