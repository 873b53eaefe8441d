"""The GPU path's own checks, with torch and transformers only (no vLLM): run on a borrowed GPU in a few minutes.

    python scripts/gpu_check.py          # on CUDA (about 5 minutes on one GPU)
    python scripts/gpu_check.py --cpu    # the same checks, smaller, on CPU (the test suite runs this)

Each check prints one JSON line; the last line is the summary, {"ok": ..., "failed": [...], ...}:
1. mixed precision: 20 AdamW steps at lr 1e-6 with float32 master weights under bf16 autocast change > 90 % of the
   weights (pure bf16 changes ~2 %);
2. the chunked LM head: the same logprobs and gradients as the unchunked head at Qwen's 151,936-token vocabulary,
   with its peak memory (CUDA's allocator counts it; on CPU only the numbers are compared);
3. FSDP2 with world size 1 (NCCL on CUDA, gloo on CPU): one mixed-precision step through `shard`;
4. checkpoint and resume: two steps straight, and one step, a checkpoint, a resume and the second step, give the
   same weights bit for bit;
5. the in-process sampler's tokens/s (`HFPolicy`, 32 prompts × 64 tokens on CUDA).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

ROOT = Path(__file__).resolve().parents[1]
_TOKENIZER = []


def importable() -> None:
    """agentrl from this checkout when it is not installed: its subpackages live beside `agentrl/` (package-dir)."""
    import importlib.util

    if importlib.util.find_spec("agentrl") is not None:
        return
    # the package's search path is set before its __init__ runs (which imports agentrl.tools): agentrl.trainers ->
    # trainers/, as pyproject.toml's package-dir maps
    spec = importlib.util.spec_from_file_location("agentrl", ROOT / "agentrl" / "__init__.py",
                                                  submodule_search_locations=[str(ROOT / "agentrl"), str(ROOT)])
    sys.modules["agentrl"] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def tokenizer():
    """The tiny model's byte-level BPE (trained here in a second: no hub on a borrowed machine)."""
    if not _TOKENIZER:
        from agentrl.models.tiny import TinyModelSettings, train_tokenizer

        _TOKENIZER.append(train_tokenizer(TinyModelSettings(vocab_size=512)))
    return _TOKENIZER[0]


def small_qwen(vocab: int, layers: int, hidden: int, device: str) -> torch.nn.Module:
    """A Qwen2 of the given size with N(0, 0.02) weights, as pretrained models have."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return AutoModelForCausalLM.from_config(config).to(device)


def batch(vocab: int, rows: int, length: int, device: str):
    """`rows` × `length` tokens, the first quarter of each row prompt (mask 0); with rows × length = vocab, every
    token once, so every embedding row is trained."""
    from agentrl.trainers.batch import Batch

    g = torch.Generator().manual_seed(0)
    ids = (torch.randperm(vocab, generator=g)[:rows * length].view(rows, length) if rows * length <= vocab
           else torch.randint(0, vocab, (rows, length), generator=g))
    mask = torch.ones(ids.shape)
    mask[:, : length // 4] = 0
    adv = torch.randn(rows, 1, generator=g) * mask
    uniform = -math.log(vocab)  # what a fresh model's logprobs are near: the PPO ratios start at about 1
    return Batch(ids, torch.ones_like(ids), mask, torch.full(ids.shape, uniform) * mask, adv).to(device)


def check_mixed_precision(device: str, big: bool) -> dict:
    from agentrl.policy.precision import mixed_precision
    from agentrl.trainers.methods.grpo import GRPOConfig
    from agentrl.trainers.loop import update

    model = mixed_precision(small_qwen(1024, 2, 256 if big else 64, device), torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    data = batch(1024, 4, 256, device)
    update(model, None, optimizer, data, GRPOConfig(epochs=20, minibatch_size=4, max_grad_norm=1e9),
           torch.Generator().manual_seed(0))
    changed = sum((p.detach() != b).sum().item() for p, b in zip(model.parameters(), before))
    share = changed / sum(b.numel() for b in before)
    return {"check": "mixed_precision", "ok": share > 0.9, "weights_changed": round(share, 4)}


def check_chunked_head(device: str, big: bool) -> dict:
    from agentrl.policy.logprobs import HEAD_CHUNK, token_logprobs

    vocab, tokens = 151_936, (8192 if big else 1500)  # several chunks, the last one partial
    model = small_qwen(vocab, 1, 256 if big else 64, device)
    ids = torch.randint(0, vocab, (1, tokens + 1), device=device)
    mask = torch.ones(ids.shape, device=device)
    mask[:, 0] = 0

    def run(chunk: int | None) -> tuple[torch.Tensor, torch.Tensor, float]:
        model.zero_grad()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        logp, _ = token_logprobs(model, ids, torch.ones_like(ids), False, mask, head_chunk=chunk)
        logp.sum().backward()
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20 if device == "cuda" else float("nan")
        return logp.detach(), model.lm_head.weight.grad.detach().clone(), peak

    chunked, grad_chunked, peak_chunked = run(HEAD_CHUNK)
    full, grad_full, peak_full = run(None)
    diff = max((chunked - full).abs().max().item(), (grad_chunked - grad_full).abs().max().item())
    ratio = peak_chunked / peak_full if device == "cuda" else None
    ok = diff <= 1e-4 and (ratio is None or ratio <= 0.25)
    return {"check": "chunked_head", "ok": ok, "max_abs_diff": diff, "peak_mib_chunked": peak_chunked,
            "peak_mib_full": peak_full, "ratio": ratio, "tokens": tokens, "vocab": vocab}


def check_fsdp(device: str, big: bool) -> dict:
    import torch.distributed as dist

    from agentrl.policy.precision import mixed_precision
    from agentrl.trainers import distributed
    from agentrl.trainers.methods.grpo import GRPOConfig
    from agentrl.trainers.loop import update

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29517"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    distributed.init()
    try:
        model = distributed.shard(mixed_precision(small_qwen(1024, 2, 128, device), torch.bfloat16))
        before = [p.detach().full_tensor().clone() for p in model.parameters()]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        metrics = update(model, None, optimizer, batch(1024, 4, 128, device), GRPOConfig(minibatch_size=4),
                         torch.Generator().manual_seed(0))
        moved = any((p.detach().full_tensor() != b).any().item() for p, b in zip(model.parameters(), before))
        shard_dtype = next(model.parameters()).dtype
    finally:
        dist.destroy_process_group()
    ok = moved and shard_dtype == torch.float32 and torch.isfinite(torch.tensor(metrics["loss"])).item()
    return {"check": "fsdp2_world_1", "ok": ok, "loss": metrics["loss"], "shards": str(shard_dtype)}


def check_resume(device: str, big: bool) -> dict:
    from agentrl.policy.precision import mixed_precision
    from agentrl.trainers.checkpoint import save_checkpoint
    from agentrl.trainers.distributed import resume
    from agentrl.trainers.methods.grpo import GRPOConfig
    from agentrl.trainers.loop import update

    cfg, data = GRPOConfig(minibatch_size=2, epochs=1), batch(1024, 4, 128, device)

    def step(model, optimizer, k: int) -> None:
        update(model, None, optimizer, data, cfg, torch.Generator().manual_seed(k))

    def fresh():
        model = mixed_precision(small_qwen(1024, 2, 128, device), torch.bfloat16)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    straight, opt = fresh()
    step(straight, opt, 0)
    step(straight, opt, 1)
    with tempfile.TemporaryDirectory() as out:
        first, opt = fresh()
        step(first, opt, 0)
        save_checkpoint(Path(out), 1, first, tokenizer(), state={"data_position": 0}, optimizer=opt)
        resumed, opt = fresh()
        resume(resumed, opt, Path(out), lambda checkpoint, state: None)
        step(resumed, opt, 1)
    same = all(torch.equal(a, b) for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()))
    return {"check": "checkpoint_resume", "ok": same, "bit_exact": same}


def check_sampler(device: str, big: bool) -> dict:
    from agentrl.policy.hf import HFPolicy
    from agentrl.policy.protocol import SamplingParams

    model = small_qwen(151_936 if big else 4096, 4 if big else 2, 512 if big else 128, device).eval()
    policy = HFPolicy(model, tokenizer())
    prompts = [[1 + i, 2, 3, 4, 5, 6, 7, 8] for i in range(32 if big else 8)]
    sampling = SamplingParams(max_tokens=64 if big else 16, temperature=1.0)

    async def sample() -> int:
        samples = await asyncio.gather(*(policy.generate(p, sampling) for p in prompts))
        return sum(len(s[0].token_ids) for s in samples)

    start = time.perf_counter()
    tokens = asyncio.run(sample())
    seconds = time.perf_counter() - start
    asyncio.run(policy.close())
    return {"check": "sampler_tokens_per_s", "ok": tokens > 0, "tokens_per_s": round(tokens / seconds, 1),
            "tokens": tokens}


CHECKS = [check_mixed_precision, check_chunked_head, check_fsdp, check_resume, check_sampler]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on CPU, at smaller sizes")
    args = parser.parse_args()
    importable()
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device visible; run with --cpu to check on CPU"}))
        return 2
    if device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS: resume is bit-exact
        torch.use_deterministic_algorithms(True, warn_only=True)
    results = []
    for check in CHECKS:
        start = time.perf_counter()
        try:
            result = check(device, big=device == "cuda")
        except Exception as e:  # one broken check must not hide the others
            result = {"check": check.__name__.removeprefix("check_"), "ok": False,
                      "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=3)}
        result["seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps(result), flush=True)
        results.append(result)
    failed = [r["check"] for r in results if not r["ok"]]
    print(json.dumps({"ok": not failed, "failed": failed, "device": torch.cuda.get_device_name(0)
                      if device == "cuda" else "cpu", "torch": torch.__version__}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
