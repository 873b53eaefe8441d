"""Mixed precision (`agentrl.policy.precision`): float32 master weights with bf16 autocast forwards keep the small
AdamW updates that pure bf16 rounds away; the autocast forward computes what a bf16 model computes, and the
in-process sampler that shares the model decodes under the same autocast; LoRA merges in float32 and is rounded
once; a bfloat16 training job checkpoints and resumes its float32 master weights."""

import asyncio
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen2Config

from agentrl.config import ConfigError, load_config
from agentrl.models.tokenizer import load_tokenizer
from agentrl.policy.hf import HFPolicy
from agentrl.policy.logprobs import token_logprobs
from agentrl.policy.precision import autocast, compute_dtype, mixed_precision
from agentrl.policy.protocol import SamplingParams
from agentrl.policy.weights import export_state_dict, lora_layers
from agentrl.trainers.batch import Batch
from agentrl.trainers.methods.grpo import GRPOConfig
from agentrl.trainers.loop import update
from agentrl.trainers.lora import LoraSettings, add_lora
from agentrl.trainers.job.pipeline import run
from agentrl.trainers.job.recipe import TrainJob

V = 256


def small_model(dtype: torch.dtype) -> torch.nn.Module:
    """A 2-layer Qwen2 with N(0, 0.02) weights (as pretrained LLMs have), small enough to step 20 times quickly."""
    config = Qwen2Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def every_token_batch() -> Batch:
    """Every id of the vocabulary once, so every embedding row (but each row's last input) gets a gradient."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(V, generator=g).view(4, V // 4)
    mask = torch.ones(ids.shape)
    mask[:, 0] = 0
    adv = torch.randn(4, 1, generator=g) * mask
    return Batch(ids, torch.ones_like(ids), mask, torch.full(ids.shape, -5.5) * mask, adv)


def changed_share(model: torch.nn.Module) -> tuple[float, float]:
    """(share of all weights, share of norm weights) that 20 AdamW steps at lr 1e-6 change, through the loop's
    update (`optimize`: the autocast around the loss)."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    cfg = GRPOConfig(epochs=20, minibatch_size=4, max_grad_norm=1e9)  # 20 passes of one minibatch: 20 steps
    update(model, None, optimizer, every_token_batch(), cfg, torch.Generator().manual_seed(0))
    moved = {n: p.detach() != before[n] for n, p in model.named_parameters()}
    norms = [n for n in moved if "norm" in n]
    share = lambda names: sum(moved[n].sum().item() for n in names) / sum(moved[n].numel() for n in names)  # noqa: E731
    return share(list(moved)), share(norms)


def test_master_weights_keep_the_small_updates_that_pure_bf16_rounds_away():
    pure_all, pure_norms = changed_share(small_model(torch.bfloat16))
    mixed, seen = mixed_precision(small_model(torch.float32), torch.bfloat16), []
    mixed.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    mixed_all, mixed_norms = changed_share(mixed)
    assert all(p.dtype == torch.float32 for p in mixed.parameters())  # the masters stay float32
    assert seen and set(seen) == {torch.bfloat16}  # `optimize` ran the loss's forwards under autocast
    # measured: pure bf16 0.022 of all weights and 0 of the norm weights; mixed 0.998 and 1.0 (float32: 0.998)
    assert mixed_all > 0.9 and mixed_norms > 0.9, (mixed_all, mixed_norms)
    assert pure_all < 0.1 and pure_norms < 0.01, (pure_all, pure_norms)


def test_an_unmarked_model_computes_in_its_parameters_dtype():
    unmarked = small_model(torch.float32)
    assert compute_dtype(unmarked) is None and compute_dtype(mixed_precision(unmarked, None)) is None
    with autocast(unmarked):
        assert not torch.is_autocast_enabled("cpu")
    with autocast(mixed_precision(unmarked, torch.bfloat16)):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        mixed_precision(unmarked, torch.float32)


def test_autocast_logprobs_are_a_bf16_models_and_the_shared_sampler_decodes_under_it(tiny_model_dir):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 4000, (3, 48), generator=g)
    attention, mask = torch.ones_like(ids), torch.ones(ids.shape)
    mask[:, :6] = 0
    keep = mask > 0

    def logprobs(model):
        with torch.no_grad(), autocast(model):
            return token_logprobs(model, ids, attention, mask_BT=mask)[0][keep]

    fp32 = logprobs(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    bf16 = logprobs(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16))
    mixed_model = mixed_precision(AutoModelForCausalLM.from_pretrained(tiny_model_dir), torch.bfloat16)
    mixed = logprobs(mixed_model)
    noise = (bf16 - fp32).abs().max().item()  # bf16's own rounding: measured 8e-3 nats
    assert (mixed - fp32).abs().max().item() > 1e-4  # it computes in bf16, not in float32
    assert (mixed - bf16).abs().max().item() < 2 * noise  # and agrees with a bf16 model to bf16's noise

    # the in-process sampler that shares the marked model decodes under the same autocast
    seen = []
    mixed_model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    policy = HFPolicy(mixed_model, load_tokenizer(tiny_model_dir))
    asyncio.run(policy.generate(ids[0, :8].tolist(), SamplingParams(max_tokens=4, temperature=1.0, seed=0)))
    asyncio.run(policy.close())
    assert seen and set(seen) == {torch.bfloat16}


def test_lora_merges_in_float32_and_is_rounded_once(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    add_lora(model, LoraSettings(r=4, alpha=8))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # early in training: deltas far below the bf16 spacing of W (~1e-4 for |W| ~ 0.02)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 1e-4)
    layers = lora_layers(model)
    exported, plain = export_state_dict(model, torch.bfloat16), export_state_dict(model)
    assert all(t.dtype == torch.bfloat16 for t in exported.values() if t.is_floating_point())
    differs_from_rounding_twice = []
    for name, layer in layers.items():
        W, delta = layer.base_layer.weight.detach(), layer.get_delta_weight("default").detach().float()
        assert torch.equal(exported[f"{name}.weight"], (W + delta).to(torch.bfloat16))  # round_bf16(W + ΔW)
        assert torch.equal(plain[f"{name}.weight"], W + delta)  # no dtype: float32, as the model holds it
        twice = W.to(torch.bfloat16) + delta.to(torch.bfloat16)  # what a bf16 W plus a bf16 delta gives
        differs_from_rounding_twice.append((twice != exported[f"{name}.weight"]).float().mean().item())
    assert sum(differs_from_rounding_twice) / len(layers) > 0.01  # the single rounding matters


ROLLOUT = {"max_total_tokens": 512, "sampling": {"max_tokens": 12}}


def job(model_dir, out_dir, steps: int, **extra):
    return load_config(TrainJob, {
        "env": "math/arith-v0", "model": str(model_dir), "out_dir": str(out_dir), "dtype": "bfloat16",
        "train_tasks": 8, "env_kwargs": {"parser": "react", "max_turns": 2}, "eval": None,
        "grpo": {"steps": steps, "tasks_per_step": 2, "minibatch_size": 4, "lr": 1e-6, "checkpoint_every": 1,
                 "group_size": 4,  # 4 coins: a group whose rewards all agree (no gradient, no step) is rare
                 "reward": {"terms": {"random": 1.0}},  # a seeded coin: the random model gets a gradient
                 "rollout": ROLLOUT}, **extra})


def test_job_dtype_options_are_checked(tiny_model_dir, tmp_path):
    assert job(tiny_model_dir, tmp_path, 1).master_weights
    with pytest.raises(ConfigError, match="loss scaling"):
        job(tiny_model_dir, tmp_path, 1, dtype="float16")
    with pytest.raises(ConfigError, match="no other copy"):
        job(tiny_model_dir, tmp_path, 1, dtype="float32", master_weights=False)


@pytest.mark.slow
def test_bf16_job_trains_float32_master_weights_and_resumes(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    run(job(tiny_model_dir, out, 2), log=lambda _: None)
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    saved = load_file(out / "checkpoints" / "step-000002" / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in saved.values())  # the masters, not a bf16 copy
    trained = [k for k in saved if "embed_tokens" not in k]  # embedding rows of unseen tokens get no gradient
    moved = sum((saved[k] != start[k]).sum().item() for k in trained) / sum(saved[k].numel() for k in trained)
    assert moved > 0.9, moved  # lr 1e-6 moves the weights (pure bf16: 0.022 in the test above)

    run(job(tiny_model_dir, out, 3), log=lambda _: None)  # resumes from step 2's float32 weights
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    resumed = load_file(out / "checkpoints" / "step-000003" / "model.safetensors")
    moved = sum((resumed[k] != saved[k]).sum().item() for k in trained) / sum(saved[k].numel() for k in trained)
    assert moved > 0.9, moved
