"""Each research method runs end to end through `agentrl train` on the tiny model, from a recipe dict."""

import json
import shutil

import pytest
from transformers import AutoModelForCausalLM

from agentrl.config import ConfigError, load_config
from agentrl.env.registry import make
from agentrl.rollout.jsonl import read_jsonl
from agentrl.models.tokenizer import load_tokenizer
from agentrl.trainers.checkpoint import latest_checkpoint
from agentrl.trainers.methods import METHODS
from agentrl.trainers.job.pipeline import JobMismatch, check_shardable, run
from agentrl.trainers.job.recipe import TrainJob

ROLLOUT = {"max_total_tokens": 512, "sampling": {"max_tokens": 12, "temperature": 0.0}}
GRPO = {"steps": 2, "tasks_per_step": 2, "minibatch_size": 4, "lr": 1e-3, "group_size": 2,
        "rollout": {**ROLLOUT, "sampling": {"max_tokens": 12}}}


def job(model_dir, out_dir, **sections):
    return load_config(TrainJob, {"env": "math/arith-v0", "model": str(model_dir), "out_dir": str(out_dir),
                                  "train_tasks": 8, "env_kwargs": {"parser": "react", "max_turns": 3},
                                  "eval": {"split": "heldout", "n": 3, "rollout": ROLLOUT}, **sections})


def metrics(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_tandem_reports_handoff_robustness(tiny_model_dir, tmp_path):
    coin = {**GRPO, "reward": {"terms": {"env": 1.0, "random": 0.5}}}  # varied rewards: both steps train
    summary = run(job(tiny_model_dir, tmp_path, grpo=coin, tandem={"eval_p": [0.5], "eval_after": [2]}),
                  log=lambda _: None)
    for when in ("before", "after"):
        assert set(summary[when]["handoff"]) == {"junior_xent", "p=0.5", "after=2"}
        assert summary[when]["handoff"]["junior_xent"] > 0
    # before RL the junior is the senior: its cross-entropy on the senior's tokens is the senior's own NLL
    solo = read_jsonl(tmp_path / "heldout" / "before_RL" / "trajectories.jsonl")
    sampled = [lp for t in solo for lp, m in zip(t.logprobs, t.loss_mask) if m]
    assert summary["before"]["handoff"]["junior_xent"] == pytest.approx(-sum(sampled) / len(sampled), abs=1e-4)
    # each saved held-out episode carries its success (`agentrl compare` pairs them): they make up the rate
    assert summary["before"]["successes"] == sum(t.metrics["success"] for t in solo) and len(solo) == 3
    rows = metrics(tmp_path)
    assert len(rows) == 2 and rows[0]["sampler_logprob_diff_max"] < 1e-4


@pytest.mark.slow
def test_tango_co_trains_a_verifier(tiny_model_dir, tmp_path):
    run(job(tiny_model_dir, tmp_path, grpo=GRPO, tango={"verifier_warmup": 4, "verifier_group_size": 2,
                                                       "alpha_start": 0.8, "alpha_end": 0.2}), log=lambda _: None)
    rows = metrics(tmp_path)
    assert [r["alpha"] for r in rows] == pytest.approx([0.8, 0.2])
    v = rows[0]["verifier"]
    assert v["episodes"] == 2 * 4 and {"format_rate", "step_agreement", "success"} <= set(v)  # 4 trajectories × 2
    assert latest_checkpoint(tmp_path).name == "step-000002"
    AutoModelForCausalLM.from_pretrained(tmp_path / "verifier")


@pytest.mark.slow
def test_tango_resumes_mid_run_with_the_same_metrics(tiny_model_dir, tmp_path):
    """Killed after step 1 of 2, the run resumes from that checkpoint (generator, verifier, both optimizers, RNGs,
    data position) and its step 2 is the uninterrupted run's."""
    tango = {"verifier_warmup": 4, "verifier_group_size": 2}
    quiet = lambda _: None  # noqa: E731
    run(job(tiny_model_dir, tmp_path / "straight", grpo={**GRPO, "checkpoint_every": 1}, tango=tango), log=quiet)
    run(job(tiny_model_dir, tmp_path / "resumed", grpo={**GRPO, "steps": 1}, tango=tango), log=quiet)  # "killed"
    resumed_log = []
    run(job(tiny_model_dir, tmp_path / "resumed", grpo=GRPO, tango=tango), log=resumed_log.append)
    assert not any("verifier warm start" in line for line in resumed_log)  # the verifier came from the checkpoint
    straight, resumed = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [1, 2]
    a, b = straight[1], resumed[1]
    for key in ("mean_reward", "sampled_tokens", "alpha", "train_reward"):
        assert a[key] == b[key], key
    for x, y in zip(straight, resumed):  # a step whose groups all had equal rewards trains nothing: no loss
        assert x.get("loss") == (pytest.approx(y["loss"], abs=1e-6) if "loss" in y else None)
    assert a["verifier"]["sampled_tokens"] == b["verifier"]["sampled_tokens"]
    # the verifier's entropy on its own samples: 8.254 against 8.267 nats when the resumed run keeps the verifier
    # it started with instead of the checkpoint's
    entropy = b["verifier"].get("entropy")  # absent when the verifier's groups gave it nothing to train on
    assert a["verifier"].get("entropy") == (None if entropy is None else pytest.approx(entropy, abs=1e-5))


@pytest.mark.slow
def test_dpo_and_majority_vote_run(tiny_model_dir, tmp_path):
    dpo = {"tasks": 4, "epochs": 1, "reward": {"terms": {"random": 1.0}}, "group_size": 3,  # random: all else ties
           "rollout": {**ROLLOUT, "sampling": {"max_tokens": 12, "temperature": 1.0}}}
    summary = run(job(tiny_model_dir, tmp_path / "dpo", dpo=dpo), log=lambda _: None)
    assert summary["dpo"]["pairs"] > 0 and latest_checkpoint(tmp_path / "dpo") is not None

    grpo = {**GRPO, "reward": {"terms": {"majority_vote": 1.0, "format": 0.1}}}
    run(job(tiny_model_dir, tmp_path / "ttrl", grpo=grpo), log=lambda _: None)
    assert {"train_reward", "majority_label_accuracy", "majority_agreement"} <= set(metrics(tmp_path / "ttrl")[0])


def test_one_method_per_recipe(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="one RL method"):
        job(tiny_model_dir, tmp_path, tandem={}, tango={})
    with pytest.raises(ConfigError, match="replaces GRPO"):
        job(tiny_model_dir, tmp_path, dpo={}, grpo=GRPO)
    with pytest.raises(ConfigError, match=r"\[ppo\] replaces GRPO"):
        job(tiny_model_dir, tmp_path, ppo={}, grpo=GRPO)
    # the method is the one table of METHODS the recipe has, GRPO without any
    tables = {m: {"teacher": str(tiny_model_dir)} if m == "distill" else {} for m in METHODS if m != "grpo"}
    assert [job(tiny_model_dir, tmp_path, **{m: tables[m]} if m != "grpo" else {}).method for m in METHODS] == \
        list(METHODS)
    with pytest.raises(ValueError, match=r"remove \['tango'\]"):  # not shardable: refused under torchrun
        check_shardable(job(tiny_model_dir, tmp_path, tango={}))


@pytest.mark.slow
def test_warm_start_stages_are_saved_and_not_redone(tiny_model_dir, tmp_path):
    stages = {"warmup": {"steps": 3, "batch_size": 4, "context_steps": 2, "context_len": 64, "context_batch_size": 2,
                         "context_episodes": 3, "context_vocab_steps": 2},
              "grpo": {"steps": 0}, "eval": None,
              "sft": {"episodes": 4, "config": {"epochs": 1, "batch_size": 4}}}
    first = []
    summary = run(job(tiny_model_dir, tmp_path, **stages), log=first.append)
    assert summary["warmup"]["steps"] == 3 and summary["sft"]["steps"] == 1 and "after" not in summary
    assert any(line.startswith("copy warm-up: 3 steps") for line in first)
    assert any(line.startswith("copy in context: 2 steps on 64-token sequences of the text of 3 expert episodes")
               for line in first)
    assert any(line.startswith(f"copy in context, spans of all {len(load_tokenizer(tiny_model_dir)) - 3} tokens: 2 "
                               "steps") for line in first)
    assert 0 <= summary["warmup"]["context_copy_accuracy"] <= 1 and 0 <= summary["warmup"]["vocab_copy_accuracy"] <= 1
    assert (tmp_path / "warmup_text.jsonl").exists()  # the env's text it copied in: expert episodes
    for stage in ("warmup_model", "sft_model"):
        AutoModelForCausalLM.from_pretrained(tmp_path / stage)
    again = []
    run(job(tiny_model_dir, tmp_path, **stages), log=again.append)
    assert not any(line.startswith(("copy warm-up:", "copy in context:", "SFT:")) for line in again)
    assert any(line.startswith("sft: done in an earlier run") for line in again)


def questions(path) -> set[str]:
    """The task questions of a demos file, as a set: episodes are written in the order they finish."""
    return {[m.content for m in t.messages if m.role == "user"][-1] for t in read_jsonl(path)}


@pytest.mark.slow
def test_sft_stages_run_in_order_each_on_its_own_env_and_resume_after_the_last_finished(tiny_model_dir, tmp_path):
    stages = {"grpo": {"steps": 0}, "eval": None,
              "sft": [{"episodes": 4, "env_kwargs": {"seed": 1}, "config": {"epochs": 1, "batch_size": 4,
                                                                            "last_turn_only": True}},
                      {"episodes": 4, "config": {"epochs": 1, "batch_size": 4}}]}
    first = []
    summary = run(job(tiny_model_dir, tmp_path, **stages), log=first.append)
    assert [line.split(":")[0] for line in first if line.startswith("SFT") and "expert episodes" in line] == \
        ["SFT 1/2", "SFT 2/2"]
    assert "last turn only; env {'seed': 1}" in next(line for line in first if line.startswith("SFT 1/2"))
    assert len(summary["sft_stages"]) == 2 and summary["sft"] == summary["sft_stages"][1]
    env = lambda **kw: make("math/arith-v0", parser="react", max_turns=3, **kw)  # noqa: E731
    assert questions(tmp_path / "sft1_demos.jsonl") == {t.data["question"] for t in list(env(seed=1).tasks)[:4]}
    assert questions(tmp_path / "sft2_demos.jsonl") == {t.data["question"] for t in list(env().tasks)[:4]}

    # killed after stage 1: a rerun loads its model and runs stage 2 only
    summary_path = tmp_path / "summary.json"
    saved = json.loads(summary_path.read_text())
    del saved["sft"]
    saved["sft_stages"] = saved["sft_stages"][:1]
    summary_path.write_text(json.dumps(saved))
    again = []
    run(job(tiny_model_dir, tmp_path, **stages), log=again.append)
    assert any(line.startswith("sft: done in an earlier run") for line in again)
    assert [line.split(":")[0] for line in again if "expert episodes" in line] == ["SFT 2/2"]


def test_engine_settings_that_cannot_work_fail_at_start_up(tiny_model_dir, tmp_path):
    """Before any server starts or model loads: a vLLM server on the trainer's GPU with vLLM's 90% share, a
    context shorter than the rollouts, a torchrun job with an IPC transfer (one GPU's memory)."""
    gpu = {"kind": "vllm", "device": "gpu"}
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        job(tiny_model_dir, tmp_path, device="cuda", engine=gpu)
    for fine in ({"gpu_memory_utilization": 0.3}, {"gpus": "1"}):
        job(tiny_model_dir, tmp_path, device="cuda", engine={**gpu, **fine})
    with pytest.raises(ConfigError, match=r"\(256\) is below the rollouts' longest trajectory \(2048 tokens"):
        job(tiny_model_dir, tmp_path, engine={"kind": "vllm", "max_model_len": 256})
    with pytest.raises(ConfigError, match="attaches to a running server"):
        job(tiny_model_dir, tmp_path, engine={"kind": "vllm", "url": "http://x", "device": "gpu", "gpus": "1"})
    with pytest.raises(ValueError, match="use 'nccl'"):
        check_shardable(job(tiny_model_dir, tmp_path, engine={**gpu, "weight_transfer": "ipc", "gpus": "1"}))
    check_shardable(job(tiny_model_dir, tmp_path, engine={**gpu, "weight_transfer": "nccl", "gpus": "1"}))
    assert job(tiny_model_dir, tmp_path, engine={"kind": "vllm"}).engine.weight_transfer == "gloo"  # tied or not


def test_the_run_records_its_job_and_refuses_to_resume_another(tiny_model_dir, tmp_path):
    """OUT/job.json holds the resolved job (overrides, derived tables, defaults): it loads back as the same job. A
    resume with another job is refused before any work, the keys that differ named; the loop's steps may change."""
    first = job(tiny_model_dir, tmp_path, grpo={**GRPO, "steps": 0}, eval=None)
    run(first, log=lambda _: None)
    recorded = json.loads((tmp_path / "job.json").read_text())
    assert load_config(TrainJob, recorded) == first
    assert recorded["grpo"]["group_size"] == 2 and recorded["eval"] is None  # resolved, not the recipe
    run(job(tiny_model_dir, tmp_path, grpo={**GRPO, "steps": 0, "checkpoint_every": 0}, eval=None),
        log=lambda _: None)  # the same job, a default given explicitly
    changed = job(tiny_model_dir, tmp_path, grpo={**GRPO, "steps": 0, "lr": 0.5}, eval=None, train_tasks=4)
    with pytest.raises(JobMismatch, match=r"grpo\.lr, train_tasks differ"):
        run(changed, log=lambda _: None)
    assert json.loads((tmp_path / "job.json").read_text()) == recorded  # untouched
    del recorded["grpo"]["rollout"]["context"]  # a job.json from before a key existed: the key's default stands
    (tmp_path / "job.json").write_text(json.dumps(recorded))
    run(first, log=lambda _: None)
    run(job(tiny_model_dir, tmp_path, grpo={**GRPO, "steps": 1}, eval=None), log=lambda _: None)  # extended
    assert json.loads((tmp_path / "job.json").read_text())["grpo"]["steps"] == 1
    shutil.copytree(tmp_path, tmp_path.parent / "moved")  # a run folder moved elsewhere resumes there
    run(job(tiny_model_dir, tmp_path.parent / "moved", grpo={**GRPO, "steps": 1}, eval=None), log=lambda _: None)


def test_an_extended_run_keeps_its_evaluation_after_rl_as_the_step_it_was(tiny_model_dir, tmp_path):
    """A finished run whose `steps` are raised resumes from its last checkpoint; the evaluation it finished with
    stays as OUT/heldout/at_step_N (and the summary's "at step N") instead of being replaced, and its RL seconds
    are added to, not replaced."""
    first = run(job(tiny_model_dir, tmp_path, grpo={**GRPO, "steps": 1}), log=lambda _: None)
    finished = (tmp_path / "heldout" / "after_RL" / "results.json").read_text()
    extended = run(job(tiny_model_dir, tmp_path, grpo={**GRPO, "steps": 2}), log=lambda _: None)
    assert (tmp_path / "heldout" / "at_step_1" / "results.json").read_text() == finished
    assert extended["at step 1"] == first["after"] and "after" in extended and extended["before"] == first["before"]
    assert extended["rl_seconds"] > first["rl_seconds"] and latest_checkpoint(tmp_path).name == "step-000002"
