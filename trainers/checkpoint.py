"""Checkpoints that resume a run exactly: model (loadable with `from_pretrained`), optimizer, RNG states,
step, data position and weight version.

Each checkpoint is written to a temporary directory and renamed into place, so a run killed while
saving leaves the previous checkpoint intact. Reading one back names the file that does not read (or holds
non-finite weights), and `distributed.resume` falls back past a damaged checkpoint to the one before.
"""

from __future__ import annotations

import pickle
import random
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from safetensors import SafetensorError

from agentrl.trainers.lora import ADAPTER_FILE, has_lora, load_adapter, save_adapter
from agentrl.system.files import write_folder
from agentrl.policy.weights import save_full

def save_checkpoint(out_dir: Path, step: int, model: Any, tokenizer: Any, *, state: dict[str, Any],
                    optimizer: torch.optim.Optimizer | None = None, optimizer_state: dict[str, Any] | None = None,
                    submodels: dict[str, Any] | None = None) -> Path:
    """`state` holds what else the loop needs (data position, other optimizers' state dicts); `submodels`
    are saved with `save_pretrained` in subdirectories of the same name (e.g. PPO's critic). A sharded
    trainer passes its gathered `optimizer_state` instead of the optimizer, and a plain copy as `model`."""
    if (optimizer is None) == (optimizer_state is None):
        raise ValueError("save_checkpoint needs the optimizer, or (sharded) its gathered optimizer_state")

    def write(tmp: Path) -> None:
        save_model(model, tokenizer, tmp)
        for name, submodel in (submodels or {}).items():
            save_full(submodel, tmp / name)
        torch.save({
            "step": step, "state": state, "optimizer": optimizer_state if optimizer is None else optimizer.state_dict(),
            "rng": rng_state(),
        }, tmp / "trainer_state.pt")

    return write_folder(Path(out_dir) / "checkpoints" / f"step-{step:06d}", write)


def save_model(model: Any, tokenizer: Any, path: Path) -> None:
    """The full weights (LoRA merged: loads with `from_pretrained`), the tokenizer, and a LoRA model's
    adapters alone (what `load_model` restores)."""
    save_full(model, path)
    tokenizer.save_pretrained(path)
    if has_lora(model):
        save_adapter(model, path)


class CheckpointError(ValueError):
    """A checkpoint file that does not read back (cut by a crash, or damaged), or that holds non-finite weights."""


@contextmanager
def reading(file: Path) -> Iterator[None]:
    """Errors while reading `file` as a `CheckpointError` naming it: torch's and safetensors' own do not, and an
    empty file's EOFError would reach the CLI as if Ctrl-D were pressed (typer prints only "Aborted.")."""
    try:
        yield
    except CheckpointError:
        raise
    except (EOFError, OSError, RuntimeError, ValueError, pickle.UnpicklingError, SafetensorError) as e:
        raise CheckpointError(f"{file} does not read back, cut by a crash or damaged ({type(e).__name__}: {e})"
                              ) from None



def require_finite(state: dict[str, torch.Tensor], file: Path) -> None:
    """Refuse weights with NaN or Inf (a run that had diverged when it saved them), naming `file`."""
    bad = [name for name, tensor in state.items() if tensor.is_floating_point() and not tensor.isfinite().all()]
    if bad:
        raise CheckpointError(f"{file} holds non-finite weights ({', '.join(bad[:3])}"
                              f"{f' and {len(bad) - 3} more' if len(bad) > 3 else ''})")


def read_weights(auto_class: Any, path: Path) -> dict[str, torch.Tensor]:
    """The finite state dict of the model saved at `path` (loaded with `auto_class`), else a `CheckpointError`."""
    file = path / "model.safetensors" if (path / "model.safetensors").exists() else path  # else sharded: the folder
    with reading(file):
        state = auto_class.from_pretrained(path).state_dict()
    require_finite(state, file)
    return state


def load_model(model: Any, path: Path) -> None:
    """Restores what `save_model` wrote into the live model: all weights, or a LoRA model's adapters on top
    of its unchanged base; a `CheckpointError` naming the file if they do not read back or are not finite."""
    if not has_lora(model):
        model.load_state_dict(read_weights(type(model), path))
        return
    with reading(path / ADAPTER_FILE):
        load_adapter(model, path)
    require_finite(model.state_dict(), path / ADAPTER_FILE)


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The highest-step finished checkpoint in `out_dir/checkpoints` (one still being written is skipped), or None."""
    done = finished_checkpoints(out_dir)
    return done[-1] if done else None


def checkpoint_step(checkpoint: Path) -> int:
    """The step a checkpoint folder was written after (its name, `save_checkpoint`'s `step-NNNNNN`)."""
    return int(checkpoint.name.removeprefix("step-"))


def finished_checkpoints(out_dir: Path) -> list[Path]:
    """The checkpoints in `out_dir/checkpoints` that were written to the end (renamed into place), oldest first."""
    return sorted((Path(out_dir) / "checkpoints").glob("step-*"))  # a folder being written is hidden (`write_folder`)




def trainer_state(checkpoint: Path) -> dict[str, Any]:
    """What `save_checkpoint` wrote beside the weights: step, state, optimizer state, RNG states. Read as tensors
    and plain data only (a pickle that names other objects could run code), from a checkpoint whose files are
    its own (`own_files`)."""
    own_files(checkpoint)
    file = checkpoint / "trainer_state.pt"
    with reading(file):
        unsafe = [name for name in torch.serialization.get_unsafe_globals_in_checkpoint(file) if name not in NUMPY]
        if unsafe:  # a crafted file, or not ours
            raise CheckpointError(f"{file} names objects other than tensors and plain data ({', '.join(unsafe[:3])}), "
                                  "which could run code when loaded: refused")
        with torch.serialization.safe_globals([np._core.multiarray._reconstruct, np.ndarray, np.dtype,
                                               np.dtypes.UInt32DType]):
            return torch.load(file, weights_only=True)


# NumPy's array rebuilders: no code of the file's choosing runs. Checkpoints before 2026-12-05 hold the NumPy
# generator's state as an array; later ones as a tensor.
NUMPY = {"numpy._core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype", "numpy.dtypes.UInt32DType"}


def own_files(checkpoint: Path) -> None:
    """A `CheckpointError` unless every entry under `checkpoint` is a plain file or folder: a symlink would resume
    another run's (or step's) weights without a word, and a FIFO would hang the resume."""
    for entry in [checkpoint, *checkpoint.rglob("*")]:
        if entry.is_symlink() or not (entry.is_file() or entry.is_dir()):
            kind = "a symlink" if entry.is_symlink() else "not a regular file"
            raise CheckpointError(f"{entry} is {kind}; a checkpoint holds only the files that save_checkpoint "
                                  "wrote")


def rng_state() -> dict[str, Any]:
    """Every generator a resumed run must continue: Python's, NumPy's, torch's CPU one and, where CUDA is in use,
    each GPU's (dropout and the in-process sampler draw there). Plain data and tensors only (`trainer_state`)."""
    name, keys, position, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), position,
                                                    has_gauss, gauss), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore `rng_state()`. GPU states saved on a machine with CUDA need one here with as many GPUs."""
    random.setstate(state["python"])
    name, keys, position, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), position, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        if not torch.cuda.is_available() or torch.cuda.device_count() < len(state["cuda"]):
            raise CheckpointError(f"this checkpoint holds the random state of {len(state['cuda'])} GPU(s), but "
                                  f"{torch.cuda.device_count() if torch.cuda.is_available() else 'no'} are visible "
                                  "here: resume on the same GPUs (CUDA_VISIBLE_DEVICES) so that the run continues")
        torch.cuda.set_rng_state_all(state["cuda"])
