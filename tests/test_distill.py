"""On-policy distillation (`trainers/methods/distill.py`): its advantage by hand, the settings it refuses, and a student
that learns its teacher's answer from nothing but the teacher's scores of the student's own tokens."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl.config import load_config
from agentrl.env.registry import make
from agentrl.models.tokenizer import load_tokenizer
from agentrl.renderer import Renderer
from agentrl.trainers.advantages import distillation_advantages
from agentrl.trainers.checkpoint import latest_checkpoint, save_model
from agentrl.trainers.job.dry_run import Hardware, plan
from agentrl.trainers.job.pipeline import run
from agentrl.trainers.job.recipe import TrainJob
from agentrl.trainers.methods.distill import DistillConfig, DistillStage

ENV = {"parser": "react", "max_turns": 1}  # one sampled token per episode (below): the first of the answer


def job(model_dir, out_dir, **distill):
    rollout = {"max_total_tokens": 512, "sampling": {"max_tokens": 1, "temperature": 1.0}}
    return load_config(TrainJob, {"env": "math/arith-v0", "model": str(model_dir), "out_dir": str(out_dir),
                                  "train_tasks": 4, "env_kwargs": ENV, "eval": None,
                                  "distill": {"rollout": rollout, **distill}})


def test_the_advantage_is_the_teachers_logprob_minus_the_students_on_sampled_tokens():
    student_BT = torch.tensor([[0.0, -1.0, -2.0, -0.5]])
    teacher_BT = torch.tensor([[0.0, -0.5, -3.0, -9.0]])
    mask_BT = torch.tensor([[0.0, 1.0, 1.0, 0.0]])  # token 3 is the env's: neither the student's nor scored
    # -0.5 - (-1) = 0.5: the teacher likes token 1 more than the student does; -3 - (-2) = -1: less
    assert distillation_advantages(student_BT, teacher_BT, mask_BT).tolist() == [[0.0, 0.5, -1.0, 0.0]]


def test_settings_that_cannot_work_are_refused(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="teacher is required"):
        DistillConfig()
    with pytest.raises(ValueError, match="set group_size >= 2"):
        DistillConfig(teacher="t", reward_coef=0.5)
    DistillConfig(teacher="t", reward_coef=0.5, group_size=2)
    with pytest.raises(ValueError, match="no teacher at .*missing.*train or fetch it first"):
        DistillStage.preflight(job(tiny_model_dir, tmp_path, teacher=str(tmp_path / "missing")))
    other = load_tokenizer(tiny_model_dir)  # one more token: the ids no longer mean the same text to both
    other.add_tokens(["<teacher-only>"])
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="has another tokenizer than the student"):
        run(job(tiny_model_dir, tmp_path / "run", teacher=str(tmp_path / "other")), log=lambda _: None)
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before any model loaded


@pytest.mark.slow
def test_the_student_learns_the_teachers_answer_from_its_scores(tiny_model_dir, tmp_path, train_to_answer):
    """The teacher is the base model trained to open every answer with `target`, the student the same trained 4 steps
    only (it samples the teacher's token 1 time in 8). The student never sees the answer, only the teacher's
    logprobs of the tokens it sampled itself; after 16 steps of 32 samples its exact KL to the teacher (first token)
    has fallen by more than a quarter and the teacher's token is far more likely. The bars hold whatever the seed: over
    seeds 0-9 the KL fell to 0.58-0.63 of its start, the token's probability rose from 0.125 to 0.47-0.50, and the
    sampled estimate's mean from 3.9-4.3 (first 8 steps) to 2.8-3.5 (last 8). With steps of 16 samples the KL ended at
    0.62-0.68, too near a bar to tell learning from the sampler's random stream."""
    tokenizer = load_tokenizer(tiny_model_dir)
    env, renderer = make("math/arith-v0", **ENV), Renderer(tokenizer)
    prompts = [tuple(renderer.prompt_ids(env.first_messages(t), env.tool_schemas)) for t in list(env.tasks)[:4]]
    target = tokenizer.encode(" 42", add_special_tokens=False)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    student = train_to_answer(base, prompts, target, steps=4)
    save_model(student, tokenizer, tmp_path / "student")
    save_model(train_to_answer(base, prompts, target), tokenizer, tmp_path / "teacher")

    teacher = AutoModelForCausalLM.from_pretrained(tmp_path / "teacher")

    def p_target(model):
        with torch.no_grad():
            return sum(model(torch.tensor([p])).logits[0, -1].softmax(-1)[target[0]].item() for p in prompts) / 4

    def kl(model):  # the exact KL(model || teacher) of the first token, averaged over the prompts
        with torch.no_grad():
            s, t = ([m(torch.tensor([p])).logits[0, -1].log_softmax(-1) for p in prompts] for m in (model, teacher))
            return sum((a.exp() * (a - b)).sum().item() for a, b in zip(s, t)) / len(prompts)

    run(job(tmp_path / "student", tmp_path / "run", teacher=str(tmp_path / "teacher"), steps=16, tasks_per_step=4,
            group_size=8, minibatch_size=32, lr=1e-3), log=lambda _: None)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = AutoModelForCausalLM.from_pretrained(latest_checkpoint(tmp_path / "run"))
    before, after = p_target(student), p_target(trained)
    assert kl(trained) < 0.75 * kl(student), (kl(student), kl(trained))
    assert after > 2 * before, (before, after)
    reverse_kl = [r["reverse_kl"] for r in rows]  # the sampled estimate the student trained on: noisy (1 token each)
    assert sum(reverse_kl[8:]) < sum(reverse_kl[:8]), reverse_kl
    assert rows[0]["sampler_logprob_diff_max"] < 1e-4  # the student's logprobs are the sampler's


def test_the_dry_run_plans_the_teachers_memory(tiny_model_dir, tmp_path):
    """The teacher sits whole beside the trainer (float32 here: 4 bytes a parameter), and counts in the total."""
    distill = plan(job(tiny_model_dir, tmp_path, teacher=str(tiny_model_dir)), Hardware(1, 80.0), 1)
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    assert distill.memory["teacher"] == 4 * params == distill.memory["weights"]
