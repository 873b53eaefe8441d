"""LoRA (Hu et al. 2021) through peft: train low-rank adapters instead of the full weights.

`add_lora` wraps the model's linear layers in place, so the in-process sampler (which holds the same
model object) samples from the adapted weights, and freezes everything else. A vLLM engine is sent the adapter
alone (`agentrl.policy.weights.save_adapter_for_engine`, docs/concepts/weight-sync.md); checkpoints get the merged
weights (`export_state_dict`) and keep the adapters alone too (`adapter.safetensors`), which is what a resumed run
loads on top of its base model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import with_config
from safetensors.torch import load_file, save_file

from agentrl.config import STRICT
from agentrl.policy.weights import lora_layers

ADAPTER_FILE = "adapter.safetensors"


@with_config(STRICT)
@dataclass(frozen=True)
class LoraSettings:
    r: int = 16
    alpha: float = 32.0  # the update is scaled by alpha / r
    dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"  # peft's choice: every linear layer but the output head

    def __post_init__(self) -> None:
        if self.r < 1 or self.alpha <= 0 or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA needs r >= 1, alpha > 0, 0 <= dropout < 1; got {self.r}, {self.alpha}, "
                             f"{self.dropout}")


def add_lora(model: torch.nn.Module, settings: LoraSettings) -> None:
    """Injects LoRA adapters into `model` in place; only they remain trainable."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise ImportError("[lora] needs peft: pip install 'agentrl[lora]'") from e
    get_peft_model(model, LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                                     target_modules=settings.target_modules))


def freeze_base_in(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """The frozen parameters (the base under the adapters) stored in `dtype`, the compute dtype: nothing updates
    them, so float32 master copies of them would only double their memory (a 7 B base: 28 GB instead of 14). The
    adapters keep their dtype (float32 master weights, for AdamW)."""
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(dtype)


def has_lora(model: torch.nn.Module) -> bool:
    """Whether `model` has LoRA layers."""
    return bool(lora_layers(model))


def save_adapter(model: torch.nn.Module, path: Path) -> None:
    """The LoRA adapter weights alone to `path/adapter.safetensors` (what `load_adapter` reads)."""
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if ".lora_" in k}, str(path / ADAPTER_FILE))


def load_adapter(model: torch.nn.Module, path: Path) -> None:
    """The adapters saved with `save_adapter` into a model with the same LoRA layout (its base unchanged)."""
    adapter = load_file(str(path / ADAPTER_FILE))
    expected = {k: v.shape for k, v in model.state_dict().items() if ".lora_" in k}
    if {k: v.shape for k, v in adapter.items()} != expected:
        raise ValueError(f"{path / ADAPTER_FILE} does not match this model's LoRA layout (different r or "
                         "target_modules?): set [lora] as in the run that wrote it")
    model.load_state_dict(adapter, strict=False)
