"""Peak memory of the LM head's forward and backward: in checkpointed chunks (`head_logprobs`, 1024 sampled tokens
at a time) against all sampled tokens at once, at Qwen2.5-0.5B's head (vocabulary 151,936, hidden 896), float32.

    python bench/chunked_head.py [--quick] [--tokens N] [--chunk C]

Each variant runs in a fresh subprocess: hidden states [N, 896] and the head's weights are made, the peak RSS
is reset (`/proc/self/clear_refs`), then one forward (logprobs and the entropy, as the policy update asks for
them) and one backward of a weighted sum of the logprobs; the peak is the kernel's high-water mark (VmHWM) less
the RSS before the forward. So it counts every byte the forward and backward add, the weight's 545 MB gradient
included, in both variants. `MALLOC_MMAP_THRESHOLD_` is fixed at 64 KiB, so freed tensors go back to the
system at once and the RSS follows live memory (torch's CPU allocator does not cache).

The goal (issue #29): chunked / full <= 0.25 at 8,192 sampled tokens. The full head at 8,192 tokens needs about
16 GB; when the machine has less available, the full peak is measured at 2,048 and 4,096 tokens and extrapolated
linearly (it is linear in N: every [N, vocab] tensor scales with N), and the JSON says so. The largest
differences of the logprobs and of both gradients (w.r.t. hidden states and weights) are measured at the
largest N where both ran. `--quick`: 2,048 tokens, hidden 64 (the logits' size is the vocabulary's; the
hidden size sets the matmuls' time and the weight gradient's size), in chunks of 256: under a minute.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from agentrl.policy.logprobs import HEAD_CHUNK, head_logprobs
from results import record  # bench/results.py: the last line, kept in bench/results/

V, H = 151_936, 896  # Qwen2.5-0.5B


class Head(torch.nn.Module):
    """The part of a causal LM that `head_logprobs` calls: the output embeddings and the config."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(hidden, V, bias=False)
        self.config = SimpleNamespace(final_logit_softcapping=None)

    def get_output_embeddings(self) -> torch.nn.Module:
        """The output projection."""
        return self.lm_head


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(tokens: int, hidden: int, chunk: int | None, save: str | None) -> dict:
    """One variant in this process: the peak MiB its forward and backward add, and their seconds."""
    torch.manual_seed(0)
    head = Head(hidden)
    hidden_NH = torch.randn(tokens, hidden).requires_grad_(True)
    targets_N, weights_N = torch.randint(0, V, (tokens,)), torch.randn(tokens)
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark back to the current RSS
    before, start = _status_kib("VmRSS"), time.perf_counter()
    logp_N, entropy_N = head_logprobs(head, hidden_NH, targets_N, with_entropy=True, chunk=chunk)
    (logp_N * weights_N).sum().backward()
    seconds, peak = time.perf_counter() - start, _status_kib("VmHWM")
    if save:
        torch.save({"logp": logp_N.detach(), "entropy": entropy_N, "hidden_grad": hidden_NH.grad,
                    "weight_grad": head.lm_head.weight.grad}, save)
    return {"peak_mib": round((peak - before) / 1024, 1), "seconds": round(seconds, 1)}


def run(tokens: int, hidden: int, chunk: int | None, save: str | None = None) -> dict:
    """`worker` in a fresh subprocess."""
    cmd = [sys.executable, __file__, "--worker", "--tokens", str(tokens), "--hidden", str(hidden),
           "--chunk", str(chunk or 0)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(cmd + (["--save", save] if save else []), env=env, check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"  N={tokens:5d} hidden={hidden} chunk={chunk or 'all':>4}: {result['peak_mib']:8.1f} MiB "
          f"{result['seconds']:6.1f} s", flush=True)
    return result


def max_diffs(a_path: str, b_path: str) -> dict[str, float]:
    """The largest absolute differences between two saved variants' outputs."""
    a, b = torch.load(a_path), torch.load(b_path)
    return {f"max_abs_diff_{k}": float((a[k] - b[k]).abs().max()) for k in a}


def available_mib() -> float:
    """MemAvailable from /proc/meminfo."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2,048 tokens, hidden 64, chunks of 256 (under a minute)")
    parser.add_argument("--tokens", type=int, default=None, help="sampled tokens [default: 8192; quick: 2048]")
    parser.add_argument("--hidden", type=int, default=None, help=f"hidden size [default: {H}; quick: 64]")
    parser.add_argument("--chunk", type=int, default=None, help=f"tokens per chunk [default: {HEAD_CHUNK}; quick: 256]")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--save", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.tokens, args.hidden, args.chunk or None, args.save)))
        return
    tokens, hidden = args.tokens or (2048 if args.quick else 8192), args.hidden or (64 if args.quick else H)
    chunk = args.chunk or (256 if args.quick else HEAD_CHUNK)
    tmp = tempfile.mkdtemp(prefix="chunked_head_")
    saved = {name: os.path.join(tmp, name + ".pt") for name in ("chunked", "full")}
    try:
        bytes_per_token = 4 * V * 3.2  # the full head's peak: about three [N, vocab] float32 tensors (measured)
        if available_mib() * 2**20 > 1.2 * tokens * bytes_per_token + 2**30:
            chunked, full = run(tokens, hidden, chunk, saved["chunked"]), run(tokens, hidden, None, saved["full"])
            full_mib, extrapolated_from, diffs_at = full["peak_mib"], None, tokens
        else:  # too little memory here for the full head at this size: two smaller sizes, and a line through them
            small, large = tokens // 4, tokens // 2
            print(f"{available_mib():.0f} MiB available: the full head at {tokens} tokens would not fit; "
                  f"measuring it at {small} and {large} and extrapolating", flush=True)
            chunked = run(tokens, hidden, chunk)
            run(small, hidden, chunk, saved["chunked"])
            at_small = run(small, hidden, None, saved["full"])["peak_mib"]
            at_large = run(large, hidden, None)["peak_mib"]
            full_mib = round(at_large + (at_large - at_small) * (tokens - large) / (large - small), 1)
            extrapolated_from, diffs_at = [small, large], small
        diffs = max_diffs(saved["chunked"], saved["full"])
    finally:
        for path in saved.values():
            Path(path).unlink(missing_ok=True)
        os.rmdir(tmp)
    record(__file__, {"ratio": round(chunked["peak_mib"] / full_mib, 3), "goal": "<= 0.25",
                      "peak_mib_chunked": chunked["peak_mib"], "peak_mib_full": full_mib,
                      "full_extrapolated_from_tokens": extrapolated_from, "tokens": tokens, "chunk": chunk,
                      "vocab": V, "hidden": hidden, "dtype": "float32", "device": "cpu",
                      "seconds_chunked": chunked["seconds"], "diffs_at_tokens": diffs_at,
                      **{k: float(f"{v:.3g}") for k, v in diffs.items()}})


if __name__ == "__main__":
    main()
