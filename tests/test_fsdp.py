"""The trainer sharded with FSDP2 over 2 processes (gloo, CPU) takes the same step as one process on the whole
minibatch, and the gathered full state dict is what the engine's weight sync receives."""

from __future__ import annotations

import contextlib
import os
import shutil

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from agentrl.policy.logprobs import SHARDED_FORWARD
from agentrl.rollout.jsonl import write_jsonl
from agentrl.trainers.batch import Batch
from agentrl.trainers.methods.grpo import GRPOConfig
from agentrl.trainers.loop import update
from agentrl.trainers.losses import PolicyLossConfig


def free_port() -> None:
    """A free port for the ranks' rendezvous, in TEST_FSDP_PORT (the workers and torchrun read it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["TEST_FSDP_PORT"] = str(s.getsockname()[1])


def serve(rank: int, port: str, jobs, done) -> None:
    """Rank `rank` of the 2-rank gloo group: joins once, then runs `worker(rank, *args)` for each job until None.
    Every check of this module runs in the same two processes (one spawn, one torch import per rank)."""
    import traceback

    from agentrl.trainers import distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    assert distributed.init("gloo") == (rank, 2)
    while (job := jobs.get()) is not None:
        worker, args = job
        try:
            worker(rank, *args)
            done.put((rank, None))
        except BaseException:  # reported to the test, which fails with it
            done.put((rank, traceback.format_exc()))
    torch.distributed.destroy_process_group()


class TwoRanks:
    """Two persistent ranks; `run(worker, *args)` runs `worker(rank, *args)` on both and waits for them. A failed
    check kills them (the other rank may wait in a collective forever); the next check starts two new ones."""

    def __init__(self) -> None:
        self.ranks: list = []

    def start(self) -> None:
        free_port()
        context = mp.get_context("spawn")
        self.jobs, self.done = [context.Queue() for _ in range(2)], context.Queue()
        self.ranks = [context.Process(target=serve, args=(rank, os.environ["TEST_FSDP_PORT"], self.jobs[rank],
                                                          self.done), daemon=True) for rank in range(2)]
        for process in self.ranks:
            process.start()

    def run(self, worker, *args) -> None:
        import queue

        if not self.ranks:
            self.start()
        for jobs in self.jobs:
            jobs.put((worker, args))
        for _ in range(2):
            try:
                error = self.done.get(timeout=300)[1]
            except queue.Empty:
                error = f"{worker.__name__}: a rank did not finish within 300 s"
            if error:
                self.close(kill=True)
                pytest.fail(error)

    def close(self, kill: bool = False) -> None:
        for process, jobs in zip(self.ranks, self.jobs):
            if kill:
                process.kill()
            elif process.is_alive():
                jobs.put(None)
        for process in self.ranks:
            process.join(30)
        self.ranks = []


@pytest.fixture(scope="module")
def two_ranks():
    pool = TwoRanks()
    yield pool
    pool.close()


def on_two_ranks(two_ranks: TwoRanks, worker, tmp_path, *args) -> dict:
    """`worker(rank, *args, out)` on the 2 ranks; what rank 0 saved at `out`."""
    out = tmp_path / "rank0.pt"
    two_ranks.run(worker, *args, str(out))
    return torch.load(out)


def batch(varied: bool = False) -> Batch:
    """6 sequences with different numbers of sampled tokens (so the ranks' shares differ). `varied`: lengths 5 to
    24 tokens, so that each rank's share of a minibatch runs packed (fewer tokens than padded)."""
    g = torch.Generator().manual_seed(0)
    B, T = 6, 24 if varied else 12
    ids = torch.randint(10, 4000, (B, T), generator=g)
    attention = torch.ones(B, T, dtype=torch.long)
    mask = torch.zeros(B, T)
    if varied:
        for row, length in enumerate((24, 6, 5, 24, 7, 5)):
            attention[row, length:], mask[row, 2:length] = 0, 1
    else:
        attention[1, 9:], attention[3, 6:] = 0, 0
        mask[0, 3:], mask[1, 5:9], mask[2, 8:], mask[3, 2:6], mask[4, 1:], mask[5, 10:] = 1, 1, 1, 1, 1, 1
    adv = torch.randn(B, 1, generator=g) * mask
    return Batch(ids, attention, mask, torch.full((B, T), -8.0) * mask, adv)


def config(agg: str, rows: int = 3) -> GRPOConfig:
    # minibatches of 3 rows: one rank gets 2 rows, the other 1. No clipping and plain SGD, so that the step is
    # the gradient itself (Adam and clipping would hide a wrongly scaled one); the norm is compared instead.
    return GRPOConfig(minibatch_size=rows, epochs=2, max_grad_norm=1e9, policy_loss=PolicyLossConfig(agg=agg))


def step(model, agg: str, varied: bool = False) -> dict:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # varied: one minibatch of all 6 rows, so that each rank's 3 pack (a long row in one bin, two short in another)
    return update(model, None, optimizer, batch(varied), config(agg, 6 if varied else 3),
                  torch.Generator().manual_seed(0))


def sharded_worker(rank: int, model_dir: str, agg: str, varied: bool, out: str) -> None:
    from agentrl.trainers import distributed

    model = distributed.shard(AutoModelForCausalLM.from_pretrained(model_dir))
    assert hasattr(model, SHARDED_FORWARD)  # the step's logprobs take the masked path, the head on sampled tokens
    shapes = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    passes = []  # per decoder pass: packed (position ids restart per row, no attention mask) or padded
    model.base_model.register_forward_pre_hook(
        lambda module, args, kwargs: passes.append(kwargs.get("position_ids") is not None), with_kwargs=True)
    metrics = step(model, agg, varied)
    state = distributed.full_state_dict(model)
    if rank == 0:
        torch.save({"state": state, "local_shapes": shapes, "grad_norm": metrics["grad_norm"], "passes": passes}, out)


def streamed_worker(rank: int, model_dir: str, out: str) -> None:
    from agentrl.policy.weight_transfer import ModelWeights
    from agentrl.trainers import distributed

    model = distributed.shard(AutoModelForCausalLM.from_pretrained(model_dir))
    source = ModelWeights(model, to_cpu=True, dtype=torch.bfloat16)
    announced = [(m.name, m.dtype, tuple(m.shape)) for m in source.metadata()]
    sent = list(source)  # every rank iterates: each tensor's gather is a collective
    if rank == 0:
        torch.save({"announced": announced, "sent": sent}, out)


def from_rank0_worker(rank: int, model_dir: str, out: str) -> None:
    from unittest import mock

    from agentrl.trainers import distributed

    unread = mock.patch.object(AutoModelForCausalLM, "from_pretrained", side_effect=AssertionError("rank 1 read"))
    with unread if rank else contextlib.nullcontext():  # rank 1 must not read the weights
        model = distributed.from_pretrained(model_dir, torch.float32, None, "cpu")
    with torch.no_grad():
        logits = model(input_ids=torch.arange(10, 40).unsqueeze(0)).logits  # each rank's own forward
    state, every_ranks = distributed.full_state_dict(model), [None, None]
    torch.distributed.all_gather_object(every_ranks, logits)
    if rank == 0:
        torch.save({"state": state, "logits": every_ranks}, out)


@pytest.mark.slow
def test_only_rank0_reads_the_weights_and_every_rank_computes_with_them(two_ranks, tiny_model_dir, tmp_path):
    """The sharded trainer's start: rank 1 builds the model on the meta device and gets its shards and buffers (the
    rotary frequencies, in no state dict) from rank 0; both ranks' forwards equal the plain model's."""
    saved = on_two_ranks(two_ranks, from_rank0_worker, tmp_path, str(tiny_model_dir))
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert list(saved["state"]) == list(plain.state_dict())
    for name, tensor in plain.state_dict().items():
        assert torch.equal(saved["state"][name], tensor), name
    with torch.no_grad():
        expected = plain(input_ids=torch.arange(10, 40).unsqueeze(0)).logits
    for logits in saved["logits"]:
        torch.testing.assert_close(logits, expected)


@pytest.mark.slow
def test_a_sharded_model_streams_full_tensors_in_the_order_it_announces(two_ranks, tiny_model_dir, tmp_path):
    """What a sync by transfer sends from a model sharded over 2 ranks: each full tensor, gathered from the shards
    as it is sent, cast to the engine's dtype, in the order and shapes `metadata()` announced to the engine."""
    saved = on_two_ranks(two_ranks, streamed_worker, tmp_path, str(tiny_model_dir))
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert [name for name, _ in saved["sent"]] == list(plain)
    assert [(name, t.dtype, tuple(t.shape)) for name, t in saved["sent"]] == saved["announced"]
    for name, tensor in saved["sent"]:
        assert torch.equal(tensor, plain[name].to(torch.bfloat16)), name


@pytest.mark.slow
@pytest.mark.parametrize("agg,varied", [("token-mean", False), ("seq-mean-token-mean", False),
                                        ("token-mean", True)])
def test_sharded_step_equals_the_single_process_step(two_ranks, tiny_model_dir, tmp_path, agg, varied):
    """Also with rows of varied lengths, which each rank runs packed."""
    saved = on_two_ranks(two_ranks, sharded_worker, tmp_path, str(tiny_model_dir), agg, varied)
    assert saved["passes"] and all(saved["passes"]) == varied  # rank 0 packed every pass, or none

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    metrics = step(reference, agg, varied)
    assert saved["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-4)  # the norm over all shards
    full = dict(reference.named_parameters())
    assert set(saved["state"]) >= set(full)  # every parameter, gathered whole on rank 0
    embed = next(n for n in full if "embed_tokens" in n)
    assert saved["local_shapes"][embed][0] == full[embed].shape[0] // 2  # each rank held half of it
    moved = max((full[n] - before[n]).abs().max().item() for n in full)
    error = max((saved["state"][n] - full[n].detach()).abs().max().item() for n in full)
    # float noise of the summation order, carried through 4 SGD steps; a wrongly weighted rank
    # would be off by a share of the step itself
    assert error < 1e-3 * moved, (error, moved)
    # the gathered weights load into a plain model: what a checkpoint-path weight sync does
    synced = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    synced.load_state_dict(saved["state"], strict=True)
    ids = batch().ids_BT[:2]
    # the gathered weights give the reference model's logits
    torch.testing.assert_close(synced(ids).logits, reference(ids).logits, atol=1e-3, rtol=1e-3)



def kl_worker(rank: int, model_dir: str, out: str) -> None:
    from agentrl.trainers import distributed

    model = distributed.shard(AutoModelForCausalLM.from_pretrained(model_dir))
    ref = distributed.frozen_copy(model)
    local = {n: tuple(p.to_local().shape) for n, p in ref.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = GRPOConfig(minibatch_size=3, epochs=2, max_grad_norm=1e9, kl_coef=0.5)
    metrics = update(model, ref, optimizer, batch(), cfg, torch.Generator().manual_seed(0))
    state, ref_state = distributed.full_state_dict(model), distributed.full_state_dict(ref)
    if rank == 0:
        torch.save({"state": state, "ref": ref_state, "local": local, "kl": metrics["kl"]}, out)


@pytest.mark.slow
def test_a_sharded_reference_model_gives_the_single_process_kl_step(two_ranks, tiny_model_dir, tmp_path):
    """FSDP2 modules cannot be deep-copied: `frozen_copy` builds the reference on the meta device, shards it like
    the policy and copies each rank's shards. Two steps with a KL term then equal the single process's, whose
    reference is a deep copy, and the reference stays the initial policy."""
    import copy
    saved = on_two_ranks(two_ranks, kl_worker, tmp_path, str(tiny_model_dir))
    single = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    start = {n: p.detach().clone() for n, p in single.named_parameters()}
    ref = copy.deepcopy(single).eval().requires_grad_(False)
    cfg = GRPOConfig(minibatch_size=3, epochs=2, max_grad_norm=1e9, kl_coef=0.5)
    metrics = update(single, ref, torch.optim.SGD(single.parameters(), lr=0.1), batch(), cfg,
                     torch.Generator().manual_seed(0))
    full = dict(single.named_parameters())
    embed = next(n for n in full if "embed_tokens" in n)
    assert saved["local"][embed][0] == full[embed].shape[0] // 2  # the reference is sharded too
    assert all(torch.equal(saved["ref"][n], start[n]) for n in full)  # and still the initial weights
    assert saved["kl"] > 0 and metrics["kl"] > 0  # the KL term acted (rank 0 logs its own share's)
    moved = max((full[n] - start[n]).abs().max().item() for n in full)
    error = max((saved["state"][n] - full[n].detach()).abs().max().item() for n in full)
    assert error < 1e-3 * moved, (error, moved)


def mixed_worker(rank: int, model_dir: str, out: str) -> None:
    from agentrl.policy.precision import mixed_precision
    from agentrl.trainers import distributed

    model = distributed.shard(mixed_precision(AutoModelForCausalLM.from_pretrained(model_dir), torch.bfloat16))
    shard_dtypes = {p.to_local().dtype for p in model.parameters()}
    metrics = step(model, "token-mean")
    state = distributed.full_state_dict(model)
    if rank == 0:
        torch.save({"state": state, "shard_dtypes": shard_dtypes, "grad_norm": metrics["grad_norm"]}, out)


@pytest.mark.slow
def test_sharded_mixed_precision_keeps_float32_shards_and_takes_the_mixed_step(two_ranks, tiny_model_dir, tmp_path):
    """A model marked for bf16 compute shards with FSDP2's MixedPrecisionPolicy: float32 shards (AdamW's
    masters), bf16 forwards, float32 gradient reduction; the step matches one process's autocast step to bf16's
    noise, and the gathered weights are float32."""
    from agentrl.policy.precision import mixed_precision

    saved = on_two_ranks(two_ranks, mixed_worker, tmp_path, str(tiny_model_dir))
    assert saved["shard_dtypes"] == {torch.float32}
    assert all(t.dtype == torch.float32 for t in saved["state"].values())

    reference = mixed_precision(AutoModelForCausalLM.from_pretrained(tiny_model_dir), torch.bfloat16)
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    metrics = step(reference, "token-mean")
    # FSDP casts every parameter (norms and embeddings too) to bf16, autocast only the matmuls' inputs: the two
    # bf16 forwards round differently, by far less than the step
    assert saved["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=5e-2)
    full = dict(reference.named_parameters())
    moved = max((full[n] - before[n]).abs().max().item() for n in full)
    error = max((saved["state"][n] - full[n].detach()).abs().max().item() for n in full)
    assert error < 0.1 * moved, (error, moved)


RECIPE = """
env = "math/arith-v0"
model = "{model}"
out_dir = "{out}"
[env_kwargs]
n_tasks = 32
[eval]
n = 4
[eval.rollout]
max_total_tokens = 512
[eval.rollout.sampling]
max_tokens = 16
temperature = 0.0
[{loop}]
steps = {steps}
tasks_per_step = 4
lr = 1e-3
minibatch_size = 8
checkpoint_every = 1
group_size = 4
[{loop}.reward]
terms = {{env = 1.0, random = 0.5}}   # varied rewards (a seeded coin): the random tiny model's updates are not zero
[{loop}.rollout]
max_total_tokens = 512
[{loop}.rollout.sampling]
max_tokens = 16
"""


def train(tmp_path, model_dir, out: str, steps: int, ranks: int, loop: str) -> list[dict]:
    import json
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from agentrl.system.lifetime import descendants

    recipe = tmp_path / f"{out}-{steps}.toml"
    recipe.write_text(RECIPE.format(model=model_dir, out=tmp_path / out, steps=steps, loop=loop))
    cli = str(Path(sys.executable).parent / "agentrl")
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
              os.environ["TEST_FSDP_PORT"]] if ranks > 1 else [sys.executable]
    job = subprocess.Popen([*launch, cli, "train", str(recipe)], env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:  # 10-50 s on 2 cores, with the other test worker busy
        assert job.wait(timeout=240) == 0
    except subprocess.TimeoutExpired:  # every rank's stacks into the captured stderr (`agentrl train`'s SIGUSR1)
        for pid in descendants(job.pid) if ranks > 1 else [job.pid]:  # the ranks, not torchrun
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
        time.sleep(5)
        for pid in [job.pid, *descendants(job.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        job.wait()
        raise
    return [json.loads(line) for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["grpo", "ppo"])
def test_train_command_under_torchrun(tiny_model_dir, tmp_path, loop):
    """`agentrl train` on 2 ranks: the same first step as one process, and a resumed run equals a straight one
    (PPO: its critic sharded too, and resumed with its optimizer)."""
    from safetensors.torch import load_file

    free_port()
    straight = train(tmp_path, tiny_model_dir, "sharded", 2, ranks=2, loop=loop)
    single = train(tmp_path, tiny_model_dir, "single", 1, ranks=1, loop=loop)
    assert len(straight) == 2 and len(single) == 1
    for key in ("mean_reward", "train_reward", "sampled_tokens"):  # the same rollouts from the same weights
        assert straight[0][key] == single[0][key], key
    weights = [load_file(tmp_path / run / "checkpoints" / "step-000001" / "model.safetensors") for run in
               ("sharded", "single")]
    if loop == "ppo":  # the critic's checkpoint, gathered from its shards, loads like any other
        AutoModelForTokenClassification.from_pretrained(tmp_path / "sharded" / "checkpoints" / "step-000002" / "critic")
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    # As norms over all weights: Adam's first step is about lr × sign(gradient), so a weight whose gradient is near 0
    # moves by float noise either way, and the largest single difference says little.
    moved = sum(((weights[1][k] - start[k]) ** 2).sum().item() for k in weights[1]) ** 0.5
    error = sum(((weights[0][k] - weights[1][k]) ** 2).sum().item() for k in weights[1]) ** 0.5
    # PPO: the critic's values carry float noise of the sharded forward, which whitening the advantages
    # amplifies (as it amplified the engine's noise, see test_ppo); still a small share of the step
    assert moved > 0 and error < (1e-2 if loop == "grpo" else 5e-2) * moved, (error, moved)

    # Resumed from step 1's checkpoint, step 2 again: GRPO's last checkpoint damaged (every rank passes over it
    # together, to the one before), PPO's gone (its critic resumed with its optimizer)
    shutil.copytree(tmp_path / "sharded", tmp_path / "resumed")
    last = tmp_path / "resumed" / "checkpoints" / "step-000002"
    if loop == "grpo":
        (last / "model.safetensors").write_bytes((last / "model.safetensors").read_bytes()[:4096])
    else:
        shutil.rmtree(last)
    # step 1's line marked: a resumed run keeps it, a restart (the same numbers) would not
    write_jsonl([{**row, "kept": row["step"] == 1} for row in straight], tmp_path / "resumed" / "metrics.jsonl")
    resumed = train(tmp_path, tiny_model_dir, "resumed", 2, ranks=2, loop=loop)
    assert len(resumed) == 2 and resumed[0]["kept"] and "kept" not in resumed[1]  # step 2 logged anew
    assert (last / "model.safetensors").stat().st_size > 4096  # step 2 written again
    for key in ("mean_reward", "train_reward", "sampled_tokens"):  # the same rollouts after the resume
        assert resumed[1][key] == straight[1][key], key
    # The losses agree to float noise: the in-process engine's logprobs (the ratio's denominator) depend on which
    # requests shared its batches, which timing decides (a relative 3e-8 in a loaded CI run); PPO's sharded critic's
    # round trip adds its own (3e-7 measured)
    for key in ("loss", "grad_norm") + (("value_loss",) if loop == "ppo" else ()):
        assert resumed[1][key] == pytest.approx(straight[1][key], rel=1e-6 if loop == "grpo" else 1e-5), key
