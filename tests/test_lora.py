"""LoRA: merged exports equal the adapted model, adapters round-trip through checkpoints, only adapters
train, and a whole training job with LoRA and gradient checkpointing leaves a plain transformers model."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl.config import load_config
from agentrl.models.tokenizer import load_tokenizer
from agentrl.trainers.checkpoint import latest_checkpoint, load_model, save_model
from agentrl.trainers.job.dry_run import estimate
from agentrl.trainers.lora import LoraSettings, add_lora, freeze_base_in
from agentrl.trainers.job.pipeline import run
from agentrl.trainers.job.recipe import TrainJob
from agentrl.policy.weights import export_state_dict

IDS = torch.tensor([[5, 60, 700, 8, 900, 10, 11]])


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def adapted(model_dir, seed=0, r=4):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    add_lora(model, LoraSettings(r=r, alpha=8))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # peft starts B at 0 (no change); make the adapters do something
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def test_only_adapters_are_trainable(tiny_model_dir):
    model = adapted(tiny_model_dir)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)


def test_export_merges_adapters_into_a_plain_model(tiny_model_dir, tmp_path):
    model = adapted(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.allclose(logits(model), logits(base), atol=1e-3)  # the adapters matter
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    plain.load_state_dict(export_state_dict(model))  # strict: exactly the plain architecture's keys
    torch.testing.assert_close(logits(plain), logits(model), atol=1e-5, rtol=0)

    save_model(model, load_tokenizer(tiny_model_dir), tmp_path / "ckpt")
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")), logits(model),
                               atol=1e-5, rtol=0)
    fresh = adapted(tiny_model_dir, seed=1)  # other adapters on the same base
    load_model(fresh, tmp_path / "ckpt")
    torch.testing.assert_close(logits(fresh), logits(model), atol=0, rtol=0)
    with pytest.raises(ValueError, match="LoRA layout"):
        load_model(adapted(tiny_model_dir, r=8), tmp_path / "ckpt")


@pytest.mark.slow
def test_train_job_with_lora_and_gradient_checkpointing(tiny_model_dir, tmp_path):
    recipe = tmp_path / "lora.toml"
    recipe.write_text(f"""
env = "math/arith-v0"
model = "{tiny_model_dir}"
out_dir = "{tmp_path / 'run'}"
gradient_checkpointing = true
[env_kwargs]
n_tasks = 16
[lora]
r = 4
[grpo]
steps = 2
tasks_per_step = 2
lr = 1e-2
checkpoint_every = 1
group_size = 4
[grpo.reward]
terms = {{random = 1.0}}   # the random model never succeeds: a seeded coin gives a gradient
[grpo.rollout]
max_total_tokens = 512
[grpo.rollout.sampling]
max_tokens = 8
[eval]
n = 4
[eval.rollout]
max_total_tokens = 512
[eval.rollout.sampling]
max_tokens = 8
temperature = 0.0
""")
    job = load_config(TrainJob, recipe)
    summary = run(job, log=lambda _: None)
    assert "before" in summary and "after" in summary
    checkpoint = latest_checkpoint(tmp_path / "run")
    trained = AutoModelForCausalLM.from_pretrained(checkpoint)  # merged: a plain transformers model
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    changed = {k for k, v in trained.state_dict().items() if not torch.equal(v, base.state_dict()[k])}
    assert changed and all(k.split(".")[-2] in {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"} for k in changed), sorted(changed)[:5]
    # resuming loads the adapters onto a fresh base: the same model as the checkpoint's merged weights
    resumed = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    add_lora(resumed, LoraSettings(r=4))
    load_model(resumed, checkpoint)
    torch.testing.assert_close(logits(resumed), logits(trained), atol=1e-5, rtol=0)


def test_the_frozen_base_is_kept_in_the_compute_dtype(tiny_model_dir):
    """With bfloat16 compute, the base under the adapters needs no float32 master copy: half its memory; the adapters
    stay float32 for AdamW. The dry run counts it so."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    add_lora(model, LoraSettings(r=4))
    freeze_base_in(model, torch.bfloat16)
    dtypes = {p.requires_grad: p.dtype for p in model.parameters()}
    assert dtypes == {True: torch.float32, False: torch.bfloat16}
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    job = load_config(TrainJob, {"env": "math/arith-v0", "model": str(tiny_model_dir), "dtype": "bfloat16",
                                 "lora": {"r": 4}})
    assert estimate(job, AutoModelForCausalLM.from_pretrained(tiny_model_dir))["weights"] == 2 * frozen + 4 * adapters


@pytest.mark.slow
def test_a_bfloat16_lora_job_trains_its_adapters_over_a_bfloat16_base(tiny_model_dir, tmp_path):
    job = load_config(TrainJob, {
        "env": "math/arith-v0", "model": str(tiny_model_dir), "out_dir": str(tmp_path / "run"), "dtype": "bfloat16",
        "env_kwargs": {"n_tasks": 8}, "lora": {"r": 4}, "eval": None,
        "grpo": {"steps": 1, "tasks_per_step": 2, "group_size": 4, "lr": 1e-2, "reward": {"terms": {"random": 1.0}},
                 "rollout": {"max_total_tokens": 512, "sampling": {"max_tokens": 8}}}})
    run(job, log=lambda _: None)
    [row] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert math.isfinite(row["loss"]) and row["sampler_logprob_diff_max"] < 0.1  # bf16 on both sides
    trained = AutoModelForCausalLM.from_pretrained(latest_checkpoint(tmp_path / "run"), dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert any(not torch.equal(v, base.state_dict()[k].to(v.dtype)) for k, v in trained.state_dict().items())
