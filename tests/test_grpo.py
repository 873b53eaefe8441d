"""The GRPO loop on the tiny model: it runs, logs, checkpoints, and resumes exactly."""

import dataclasses
import json
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from agentrl.config import load_config
from agentrl.envs.math import ArithmeticEnv
from agentrl.policy.hf import HFPolicy
from agentrl.policy.protocol import SamplingParams
from agentrl.rollout.engine import RolloutConfig
from agentrl.rollout.jsonl import read_jsonl
from agentrl.models.tokenizer import load_tokenizer
from agentrl.trainers.checkpoint import latest_checkpoint
from agentrl.trainers.methods.grpo import GRPO, GRPOConfig, train
from agentrl.trainers.metrics import EveryEpisodeFailed
from agentrl.trainers.tasks import TaskStream
from agentrl.trainers.job.recipe import TrainJob
from agentrl.types import Group, Task, Trajectory

CFG = GRPOConfig(steps=4, tasks_per_step=2, lr=1e-3, minibatch_size=4, epochs=2, checkpoint_every=1, kl_coef=0.05,
                 group_size=4, rollout=RolloutConfig(max_total_tokens=1024, sampling=SamplingParams(max_tokens=12)))


def run(model_dir, out_dir, steps):
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    policy = HFPolicy(model, tokenizer)
    tasks = list(ArithmeticEnv(n_tasks=16).tasks)
    cfg = dataclasses.replace(CFG, steps=steps)
    return train(cfg, model, tokenizer, policy, lambda: ArithmeticEnv(n_tasks=16), tasks, out_dir)


@pytest.mark.slow
def test_grpo_runs_and_resumes_exactly(tiny_model_dir, tmp_path):
    straight = run(tiny_model_dir, tmp_path / "straight", 4)
    assert len(straight) == 4
    m = straight[0]
    # the untrained model earns nothing and writes until max_tokens: 2 groups of 4 single-turn episodes of 12 tokens
    assert m["mean_reward"] == m["success"] == m["train_reward"] == 0 and m["zero_variance_groups"] == 1
    assert m["error_frac"] == 0 and m["truncated_frac"] == 1 and m["groups_trained"] == 2
    assert m["sampled_tokens"] == m["trained_tokens"] == 8 * 12
    assert m["tokens_per_s"] == pytest.approx(m["sampled_tokens"] / m["time"]["rollout"], rel=1e-9)
    assert all(v > 0 for v in m["time"].values())
    # no reward signal (all advantages 0): the loss is the KL term alone, which moves the policy once AdamW's weight
    # decay has made it differ from the reference
    assert m["loss"] == pytest.approx(CFG.kl_coef * m["kl"], rel=1e-5) and m["kl"] > 0 and m["grad_norm"] > 0
    assert 0 < m["entropy"] <= math.log(AutoConfig.from_pretrained(tiny_model_dir).vocab_size)  # nearly uniform
    assert 0 <= m["clip_frac"] <= 1 and m["approx_kl"] >= 0 and m["ratio_min"] <= m["ratio_mean"] <= m["ratio_max"]
    assert m["sampler_logprob_diff_max"] < 1e-4  # before the first update, trainer logprobs == sampler's

    run(tiny_model_dir, tmp_path / "resumed", 2)  # "killed" after step 2: only its checkpoint survives
    assert latest_checkpoint(tmp_path / "resumed").name == "step-000002"
    resumed = run(tiny_model_dir, tmp_path / "resumed", 4)
    assert len(resumed) == 2
    for a, b in zip(straight[2:], resumed):
        assert a["mean_reward"] == b["mean_reward"] and a["sampled_tokens"] == b["sampled_tokens"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    lines = (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4]
    # the checkpoint is a plain transformers model
    AutoModelForCausalLM.from_pretrained(latest_checkpoint(tmp_path / "resumed"))


class DaemonGone(ArithmeticEnv):
    """Every episode fails, as an env's whose sandbox daemon died."""

    def on_reset(self, task):
        raise RuntimeError("no Docker daemon answers")


def test_a_step_whose_every_episode_ended_in_error_stops_the_run_before_logging_it(tiny_model_dir, tmp_path):
    tokenizer, model = load_tokenizer(tiny_model_dir), AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(EveryEpisodeFailed, match=r"step 1: all 8 episodes ended in error .*no Docker daemon answers"):
        train(dataclasses.replace(CFG, steps=2), model, tokenizer, HFPolicy(model, tokenizer),
              lambda: DaemonGone(n_tasks=16), list(DaemonGone(n_tasks=16).tasks), tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text() == "" and latest_checkpoint(tmp_path) is None


def test_task_stream_is_deterministic_and_resumable():
    tasks = list(ArithmeticEnv(n_tasks=5).tasks)
    a = TaskStream(tasks, seed=1)
    first = a.take(7)
    b = TaskStream(tasks, seed=1, position=3)
    assert b.take(4) == first[3:]
    assert sorted(t.id for t in first[:5]) == sorted(t.id for t in tasks)  # each pass covers every task


def test_recipes_load():
    from pathlib import Path

    for recipe in sorted((Path(__file__).parents[1] / "recipes").glob("*train*.toml")):
        load_config(TrainJob, recipe)


@pytest.mark.slow
@pytest.mark.parametrize("max_staleness", [0, 1])
def test_train_pipeline_evaluates_periodically_and_per_split(tiny_model_dir, tmp_path, max_staleness):
    """Held-out evaluations during training, also asynchronous ones (on the loop where the rollouts sample, beside
    them): logged at every step but the last, pooled over the splits from their counts."""
    from agentrl.trainers.job.pipeline import run as run_job

    rollout = {"max_total_tokens": 512, "sampling": {"max_tokens": 8, "temperature": 0.0}}
    job = load_config(TrainJob, {
        "env": "math/arith-v0", "model": str(tiny_model_dir), "out_dir": str(tmp_path), "train_tasks": 8,
        "eval": {"split": ["heldout", "train"], "n": 3, "every": 1, "rollout": rollout},
        "grpo": {"steps": 2, "tasks_per_step": 2, "minibatch_size": 4, "max_staleness": max_staleness, "group_size": 2,
                 "rollout": {**rollout, "sampling": {"max_tokens": 8}}}})
    lines = []
    summary = run_job(job, log=lines.append)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "heldout" in rows[0] and "heldout" not in rows[1]  # every step, but the last is the final eval
    assert set(rows[0]["heldout"]["suites"]) == {"heldout", "train"}
    for label in ("before", "after"):  # pooled over the splits, from the counts
        pooled, suites = summary[label], summary[label]["suites"]
        assert pooled["successes"] == suites["heldout"]["successes"] + suites["train"]["successes"]
        assert pooled["valid"] == suites["heldout"]["valid"] + suites["train"]["valid"] == 6
        assert pooled["success"] == pooled["successes"] / pooled["valid"]
    saved = read_jsonl(tmp_path / "heldout" / "before_RL" / "trajectories.jsonl")  # the suite run's own files
    assert sorted(t.logs["split"] for t in saved) == ["heldout"] * 3 + ["train"] * 3
    results = json.loads((tmp_path / "heldout" / "before_RL" / "results.json").read_text())
    assert results["all"]["success"]["successes"] == summary["before"]["successes"]
    assert any("held-out (train, 3 tasks) at step 1" in line for line in lines)
    at_step_1 = read_jsonl(tmp_path / "heldout" / "at_step_1" / "trajectories.jsonl")
    assert len(at_step_1) == 6 and {t.weight_version for t in at_step_1} == {1}  # the weights after step 1


def test_an_interrupted_heldout_evaluation_of_the_same_weights_resumes(tiny_model_dir, tmp_path):
    """A run killed during its evaluation before (or after) RL has the same weights again when it resumes: the
    episodes already played are kept and only the rest are played. Other weights (an extended run's final model),
    or weights a resumed run trains again (`weights=None`), start over."""
    import agentrl
    from agentrl.renderer import Renderer
    from agentrl.trainers.job.heldout import evaluate_heldout

    job = load_config(TrainJob, {"env": "math/arith-v0", "model": str(tiny_model_dir), "out_dir": str(tmp_path),
                                 "eval": {"n": 4, "rollout": {"sampling": {"max_tokens": 8}}}})
    policy, log = HFPolicy.load(tiny_model_dir), (lambda line: None)
    path = tmp_path / "heldout" / "after_RL" / "trajectories.jsonl"

    def evaluate(weights):
        evaluate_heldout(job, policy, Renderer(policy.tokenizer), lambda split: agentrl.make(job.env, split=split),
                         log, "after RL", weights=weights)
        return [json.loads(line) for line in path.read_text().splitlines()]

    MARK = 99.999  # seconds no episode here takes

    def killed_after_two(episodes):
        """The file as a run killed after two of its four episodes leaves it, their time marked: greedy episodes
        played again are the same but for their time, which can repeat to the millisecond."""
        kept = [{**e, "metrics": {**e["metrics"], "seconds": MARK}} for e in episodes[:2]]
        path.write_text("".join(json.dumps(e) + "\n" for e in kept))
        return kept

    first = evaluate("after 2 RL steps")
    kept = killed_after_two(first)
    resumed = evaluate("after 2 RL steps")
    assert resumed[:2] == kept and len(resumed) == 4  # kept as they were, two played
    assert sorted(e["task_id"] for e in resumed) == sorted(e["task_id"] for e in first)
    for weights in ("after 3 RL steps", None, None):  # other weights, or None (even after None): played again, all
        killed_after_two(resumed)
        again = evaluate(weights)
        assert len(again) == 4 and all(e["metrics"]["seconds"] != MARK for e in again)


def test_dynamic_sampling_admits_groups_by_their_reward_spread():
    """Without dynamic sampling every group with a baseline is kept; with it, groups whose rewards do not vary are
    dropped, and `min_reward_spread` raises the bar to a range of rewards."""
    def group(*rewards):
        return Group(Task("t"), tuple(Trajectory("t", (1, 2), (0, 1), (0.0, -0.5), 1, (), r) for r in rewards))

    def kept(**settings):
        method = GRPO(GRPOConfig(**settings), torch.nn.Linear(1, 1), None)
        return [method.keep(g) for g in (group(1.0, 1.0), group(0.0, 0.25), group(0.0, 1.0), group(1.0))]

    assert kept() == [True, True, True, False]  # a lone episode has no baseline
    assert kept(dynamic_sampling=True) == [False, True, True, False]
    assert kept(dynamic_sampling=True, min_reward_spread=0.5) == [False, False, True, False]
    with pytest.raises(ValueError, match="set dynamic_sampling = true"):
        GRPOConfig(min_reward_spread=0.5)
