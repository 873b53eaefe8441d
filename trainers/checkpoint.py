"""Checkpoints that resume a run exactly: model (loadable with `from_pretrained`), optimizer, RNG states,
step, data position and weight version.

Each checkpoint is written to a temporary directory and renamed into place, so a run killed while
saving leaves the previous checkpoint intact.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from agentrl.trainers.fsdp import data_parallel, load_full_state_dict, load_optimizer_state
from agentrl.trainers.lora import has_lora, load_adapter, save_adapter
from agentrl.policy.weights import save_full


def save_checkpoint(out_dir: Path, step: int, model: Any, tokenizer: Any, *, state: dict[str, Any],
                    optimizer: torch.optim.Optimizer | None = None, optimizer_state: dict[str, Any] | None = None,
                    submodels: dict[str, Any] | None = None) -> Path:
    """`state` holds what else the loop needs (data position, other optimizers' state dicts); `submodels`
    are saved with `save_pretrained` in subdirectories of the same name (e.g. PPO's critic). A sharded
    trainer passes its gathered `optimizer_state` instead of the optimizer, and a plain copy as `model`."""
    if (optimizer is None) == (optimizer_state is None):
        raise ValueError("save_checkpoint needs the optimizer, or (sharded) its gathered optimizer_state")
    final = Path(out_dir) / "checkpoints" / f"step-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tokenizer, tmp)
    for name, submodel in (submodels or {}).items():
        save_full(submodel, tmp / name)
    torch.save({
        "step": step, "state": state, "optimizer": optimizer_state if optimizer is None else optimizer.state_dict(),
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
    }, tmp / "trainer_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def save_model(model: Any, tokenizer: Any, path: Path) -> None:
    """The full weights (LoRA merged: loads with `from_pretrained`), the tokenizer, and a LoRA model's
    adapters alone (what `load_model` restores)."""
    save_full(model, path)
    tokenizer.save_pretrained(path)
    if has_lora(model):
        save_adapter(model, path)


def load_model(model: Any, path: Path) -> None:
    """Restores what `save_model` wrote into the live model: all weights, or a LoRA model's adapters on top
    of its unchanged base."""
    if has_lora(model):
        load_adapter(model, path)
    else:
        model.load_state_dict(type(model).from_pretrained(path).state_dict())


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The highest-step finished checkpoint in `out_dir/checkpoints` (one still being written is skipped), or None."""
    done = sorted(p for p in (Path(out_dir) / "checkpoints").glob("step-*") if not p.name.endswith(".tmp"))
    return done[-1] if done else None


def resume(model: Any, optimizer: torch.optim.Optimizer, checkpoint: Path) -> dict[str, Any]:
    """Restores the model, optimizer and RNGs from `checkpoint` in place; returns {"step": ..., "state": ...}."""
    saved = torch.load(Path(checkpoint) / "trainer_state.pt", weights_only=False)
    restore(model, optimizer, checkpoint, saved["optimizer"], AutoModelForCausalLM)
    random.setstate(saved["rng"]["python"])
    np.random.set_state(saved["rng"]["numpy"])
    torch.set_rng_state(saved["rng"]["torch"])
    return {"step": saved["step"], "state": saved["state"]}


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
    load_full_state_dict(model, auto_class.from_pretrained(path).state_dict() if rank == 0 else {})
    load_optimizer_state(model, optimizer, optimizer_state if rank == 0 else {})
