"""The weights a model exports to engines and checkpoints: its full state dict, with LoRA adapters merged.

A model trained with LoRA (`agentrl.trainers.lora`) carries peft's layers: base weights under
`.base_layer.` and the adapters' `lora_A` / `lora_B`. Engines (vLLM's reload, another in-process copy) and
`from_pretrained` expect the plain architecture, so the export folds each adapter's delta into its base
weight, W + (alpha / r) B A, without touching the live model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    """peft's LoRA-wrapped modules by name; {} for a plain model (or when peft is not installed)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


@torch.no_grad()
def export_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict in its plain architecture's keys, LoRA deltas merged."""
    state = model.state_dict()
    layers = lora_layers(model)
    if not layers:
        return state
    out = {k.replace(".base_layer.", "."): v for k, v in state.items() if ".lora_" not in k}
    for name, layer in layers.items():
        delta = sum(layer.get_delta_weight(adapter) for adapter in layer.active_adapters)
        out[f"{name}.weight"] = out[f"{name}.weight"] + delta.to(out[f"{name}.weight"].dtype)
    return out


def save_full(model: Any, path: Path) -> None:
    """`save_pretrained` of the exported weights: loads with `from_pretrained`, LoRA or not."""
    model.save_pretrained(path, state_dict=export_state_dict(model), safe_serialization=True)
