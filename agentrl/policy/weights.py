"""The weights a model exports to engines and checkpoints: its full state dict, with LoRA adapters merged.

A model trained with LoRA (`agentrl.trainers.lora`) carries peft's layers: base weights under
`.base_layer.` and the adapters' `lora_A` / `lora_B`. Engines (vLLM's reload, another in-process copy) and
`from_pretrained` expect the plain architecture, so the export folds each adapter's delta into its base
weight, W + (alpha / r) B A, without touching the live model. The sum is taken in float32 and rounded once
to the export dtype: a bf16 W plus a bf16-rounded delta would round the early, small deltas away.

With mixed precision (`agentrl.policy.precision`) the parameters are float32 master weights; checkpoints keep
them so, and an engine that serves bf16 gets them cast once (`dtype`), the rounding its trainer's autocast
forward sees too.

A LoRA run whose engine serves adapters (vLLM's LoRA) syncs the adapter alone (`save_adapter_for_engine`), not
the merged weights.

A checkpoint for vLLM's `reload_weights` (`save_for_reload`) cannot carry tied embeddings: the reload leaves the
output projection on the old weights, so such a sync is refused (`refuse_tied_embeddings`) in favour of a transfer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from agentrl.policy.protocol import PolicyError


def lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    """peft's LoRA-wrapped modules by name; {} for a plain model (or when peft is not installed)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


@torch.no_grad()
def export_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's state dict in its plain architecture's keys, LoRA deltas merged in float32, and its floating
    tensors cast to `dtype` (an engine's, e.g. bfloat16; None: the dtype the model holds each one in)."""
    state = model.state_dict()
    layers = lora_layers(model)
    out = {k.replace(".base_layer.", "."): v for k, v in state.items() if ".lora_" not in k} if layers else state
    for name, layer in layers.items():
        weight = out[f"{name}.weight"]
        delta = sum(layer.get_delta_weight(adapter).float() for adapter in layer.active_adapters)
        out[f"{name}.weight"] = (weight.float() + delta).to(dtype or weight.dtype)
    if dtype is not None:  # cast once, here: a tensor already in `dtype` is passed as it is
        out = {k: v.to(dtype) if v.is_floating_point() else v for k, v in out.items()}
    return out


def save_full(model: Any, path: Path, dtype: torch.dtype | None = None) -> None:
    """`save_pretrained` of the exported weights (in `dtype`, see `export_state_dict`): loads with
    `from_pretrained`, LoRA or not."""
    model.save_pretrained(path, state_dict=export_state_dict(model, dtype), safe_serialization=True)


def ties_embeddings(config: Any) -> bool:
    """Whether a model's config ties its input and output embeddings (on itself or its text config)."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text_config, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False))


def refuse_tied_embeddings(model: Any) -> None:
    """Raise `PolicyError` for a model whose input and output embeddings are tied: vLLM's checkpoint reload
    leaves it half-updated (the weight-transfer path does not, and does not call this)."""
    if ties_embeddings(model.config):
        raise PolicyError(
            "This model ties its input and output embeddings (tie_word_embeddings=True). vLLM's checkpoint "
            "reload leaves such a model half-updated (logprobs off by 5-30 nats), so agentrl refuses to sync it "
            "that way. Sync by broadcast instead (weight_transfer 'gloo' on CPU, 'nccl' between GPUs: the server "
            "started with the same setting), which keeps them tied; or untie them once and serve the untied "
            "copy: `model.config.tie_word_embeddings = False; "
            "model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone()); "
            "model.save_pretrained(DIR)`, then `agentrl serve policy --model DIR` and train that model.")


def save_for_reload(model: Any, path: Path, dtype: Any = None) -> None:
    """The model's weights as a safetensors checkpoint directory (what `reload_weights` reads), cast to `dtype`
    (None: as the model holds them)."""
    if not hasattr(model, "save_pretrained"):
        raise PolicyError(f"sync_weights needs a transformers model (save_pretrained), got {type(model).__name__}")
    from transformers.utils import logging as hf_logging

    path.mkdir(parents=True, exist_ok=True)
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a tqdm bar per sync would drown the trainer's own progress
    try:
        save_full(model, path, dtype)  # LoRA adapters merged
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def save_adapter_for_engine(model: Any, path: Path, dtype: Any = None) -> int:
    """The model's LoRA adapter alone, as peft saves it (`adapter_model.safetensors` and `adapter_config.json`,
    what vLLM's `/v1/load_lora_adapter` reads), cast to `dtype` (None: as held); the bytes written."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    state = {f"base_model.model.{k}": (v.to(dtype) if dtype is not None else v).detach().contiguous()
             for k, v in get_peft_model_state_dict(model).items()}
    save_file(state, str(path / "adapter_model.safetensors"))
    model.peft_config["default"].save_pretrained(str(path))
    return sum(f.stat().st_size for f in path.iterdir())
