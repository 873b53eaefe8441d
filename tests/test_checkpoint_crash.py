"""Files after a crash (issue 33, point 8): JSONL logs cut mid-line, checkpoints cut or holding NaN, losses
that turn NaN. Each is named (file and line, file, or step), and what can be repaired is, the same way everywhere."""

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from agentrl.cli.main import app
from agentrl.envs.math import ArithmeticEnv
from agentrl.eval.report import load_training
from agentrl.eval.run import _read_finished
from agentrl.models.tokenizer import load_tokenizer
from agentrl.policy.hf import HFPolicy
from agentrl.policy.protocol import SamplingParams
from agentrl.rollout.engine import EnvEngines, RolloutConfig
from agentrl.rollout.jsonl import JsonlWriter, read_records
from agentrl.trainers import loop
from agentrl.trainers.checkpoint import CheckpointError, save_checkpoint
from agentrl.trainers.distributed import resume
from agentrl.trainers.methods.grpo import GRPOConfig, train
from agentrl.trainers.metrics import MetricsLogger, NonFiniteLoss
from agentrl.trainers.sft import SFTConfig, sft
from agentrl.types import Trajectory, Turn

ROWS = [{"step": 1, "note": "première"}, {"step": 2, "note": "deuxième"}]


def jsonl(path, rows, tail=b""):
    path.write_bytes(b"".join((json.dumps(r, ensure_ascii=False) + "\n").encode() for r in rows) + tail)
    return path


# ------------------------------------------------------------------------------------------------ JSONL


@pytest.mark.parametrize("tail", [b'{"step": 3, "no', '{"step": 3, "note": "é'.encode()[:-1]],
                         ids=["cut JSON", "cut inside a UTF-8 character"])
def test_a_cut_last_line_is_dropped_with_a_warning_and_repaired_before_appending(tmp_path, tail):
    path = jsonl(tmp_path / "log.jsonl", ROWS, tail)
    with pytest.warns(RuntimeWarning, match=r"log.jsonl:3: dropped a last line cut short"):
        assert read_records(path) == ROWS
    assert path.read_bytes().endswith(tail)  # reading alone leaves the file to whoever writes it
    with pytest.warns(RuntimeWarning, match="cut off the file"):
        read_records(path, repair=True)
    with JsonlWriter(path, append=True) as writer:
        writer.write({"step": 3})
    assert read_records(path) == [*ROWS, {"step": 3}]  # the append did not glue onto the cut line


def test_a_last_line_without_its_newline_gets_one_on_repair(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"step": 1}')
    read_records(path, repair=True)
    assert path.read_text() == '{"step": 1}\n'


@pytest.mark.parametrize("bad", [b'{"step": 2, "no\n', b"\xff\xfe\n", b"[1, 2]\n"])
def test_a_bad_line_before_the_last_is_an_error_naming_file_and_line(tmp_path, bad):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"step": 1}\n' + bad + b'{"step": 3}\n')
    with pytest.raises(ValueError, match=r"log.jsonl:2: "):
        read_records(path)


def test_report_names_file_and_line_of_a_damaged_metrics_jsonl(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2,\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: "):
        load_training(tmp_path)


def trajectory(task_id="t", **logs) -> Trajectory:
    ids = (1, 2, 3, 4)
    return Trajectory(task_id, ids, (0, 0, 1, 1), (0.0,) * 4, prompt_len=2, turns=(Turn(2, 4, 4),), reward=1.0,
                      logs=logs)


def test_eval_resume_survives_a_line_cut_inside_a_utf8_character(tmp_path):
    path = tmp_path / "trajectories.jsonl"
    with JsonlWriter(path) as writer:
        writer.write(trajectory("t0", entry="e", sample=0))
    whole = path.read_bytes()
    second = json.dumps(trajectory("t1", entry="é", sample=0).to_dict(), ensure_ascii=False).encode()
    path.write_bytes(whole + second[:second.index("é".encode()) + 1])  # the kill fell inside the "é"
    with pytest.warns(RuntimeWarning, match="trajectories.jsonl:2"):
        finished = _read_finished(path)
    assert list(finished) == [("e", "t0", 0)]
    assert path.read_bytes() == whole  # ready to append


def test_an_eval_file_written_before_metrics_and_logs_were_apart_still_resumes(tmp_path):
    """Trajectories of an older version kept one `info`: its numbers read back as metrics, the rest as logs."""
    path = tmp_path / "trajectories.jsonl"
    old = {k: v for k, v in trajectory("t0").to_dict().items() if k not in ("metrics", "logs")}
    old["info"] = {"entry": "e", "sample": 0, "success": True, "tool_calls": 2, "summary_tokens": [7, 9]}
    path.write_text(json.dumps(old) + "\n")
    (t,) = _read_finished(path).values()
    assert t.metrics == {"success": True, "tool_calls": 2}
    assert t.logs == {"entry": "e", "sample": 0, "summary_tokens": [7, 9]}  # a list is no metric


def test_metrics_of_a_resumed_run_keep_the_steps_up_to_its_checkpoint_and_drop_a_cut_line(tmp_path):
    jsonl(tmp_path / "metrics.jsonl", [{"step": 1}, {"step": 2}, {"step": 3}], b'{"step": 4, "los')
    with pytest.warns(RuntimeWarning, match="metrics.jsonl:4"):
        logger = MetricsLogger(tmp_path, start=2)  # resumed from step 2's checkpoint: steps 3 and 4 are redone
    logger.log(3, {"loss": 0.5})
    logger.close()
    assert read_records(tmp_path / "metrics.jsonl") == [{"step": 1}, {"step": 2}, {"step": 3, "loss": 0.5}]


# ------------------------------------------------------------------------------------------- checkpoints


def model_and_optimizer(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def save_steps(tiny_model_dir, out_dir, steps):
    model, optimizer = model_and_optimizer(tiny_model_dir)
    for step in steps:
        save_checkpoint(out_dir, step, model, load_tokenizer(tiny_model_dir), state={"data_position": step},
                        optimizer=optimizer)


def damage(file, how):
    if how == "nan":
        weights = load_file(file)
        next(iter(weights.values()))[0] = float("nan")
        save_file(weights, file, metadata={"format": "pt"})  # a valid file, with a NaN weight
    else:
        file.write_bytes(file.read_bytes()[:len(file.read_bytes()) // 2] if how == "cut" else b"")


DAMAGES = [("model.safetensors", "cut"), ("model.safetensors", "empty"), ("model.safetensors", "nan"),
           ("trainer_state.pt", "cut"), ("trainer_state.pt", "empty")]


@pytest.mark.parametrize("name, how", DAMAGES)
def test_resume_falls_back_past_a_damaged_checkpoint_with_a_warning_naming_both(tiny_model_dir, tmp_path, name,
                                                                                how):
    save_steps(tiny_model_dir, tmp_path, [1, 2])
    damage(tmp_path / "checkpoints" / "step-000002" / name, how)
    model, optimizer = model_and_optimizer(tiny_model_dir)
    with pytest.warns(RuntimeWarning, match=rf"step-000002/{name}.*previous checkpoint, .*step-000001"):
        assert resume(model, optimizer, tmp_path)["step"] == 1
    assert all(p.isfinite().all() for p in model.parameters())


@pytest.mark.parametrize("name, how", DAMAGES)
def test_a_damaged_last_checkpoint_is_an_error_naming_the_file(tiny_model_dir, tmp_path, name, how):
    save_steps(tiny_model_dir, tmp_path, [1])
    damage(tmp_path / "checkpoints" / "step-000001" / name, how)
    with pytest.raises(CheckpointError, match=rf"step-000001/{name} " + ("holds non-finite" if how == "nan"
                                                                          else "does not read back")):
        resume(*model_and_optimizer(tiny_model_dir), tmp_path)


class RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_crafted_trainer_state_is_refused_without_running_its_code(tiny_model_dir, tmp_path):
    save_steps(tiny_model_dir, tmp_path, [1])
    file, marker = tmp_path / "checkpoints" / "step-000001" / "trainer_state.pt", tmp_path / "ran"
    state = torch.load(file, weights_only=True)  # what save_checkpoint wrote reads as plain data
    torch.save({**state, "step": RunsCode(marker)}, file)
    with pytest.raises(CheckpointError, match=r"trainer_state.pt names objects other than tensors .*pathlib"):
        resume(*model_and_optimizer(tiny_model_dir), tmp_path)
    assert not marker.exists()


def test_a_checkpoint_with_the_numpy_state_as_an_array_still_resumes(tiny_model_dir, tmp_path):
    """Checkpoints written before the RNG state was saved as plain data hold NumPy's state as an array."""
    import numpy as np

    save_steps(tiny_model_dir, tmp_path, [1])
    file = tmp_path / "checkpoints" / "step-000001" / "trainer_state.pt"
    state = torch.load(file, weights_only=True)
    np.random.seed(7)
    torch.save({**state, "rng": {**state["rng"], "numpy": np.random.get_state()}}, file)
    expected = np.random.random()
    assert resume(*model_and_optimizer(tiny_model_dir), tmp_path)["step"] == 1
    assert np.random.random() == expected


@pytest.mark.parametrize("how", ["symlink to the previous step", "fifo"])
def test_a_checkpoint_file_that_is_not_its_own_is_refused(tiny_model_dir, tmp_path, how):
    """A symlinked model would resume other weights without a word; a FIFO would hang the resume for good."""
    save_steps(tiny_model_dir, tmp_path, [1, 2])
    last = tmp_path / "checkpoints" / "step-000002"
    name = "model.safetensors" if how.startswith("symlink") else "trainer_state.pt"
    (last / name).unlink()
    if how == "fifo":
        os.mkfifo(last / name)
    else:
        (last / name).symlink_to(tmp_path / "checkpoints" / "step-000001" / name)
    kind = "not a regular file" if how == "fifo" else "a symlink"
    with pytest.warns(RuntimeWarning, match=rf"step-000002/{name} is {kind}.*previous checkpoint"):
        assert resume(*model_and_optimizer(tiny_model_dir), tmp_path)["step"] == 1


def test_train_cli_names_an_empty_trainer_state_instead_of_aborting(tiny_model_dir, tmp_path):
    save_steps(tiny_model_dir, tmp_path / "run", [1])
    (tmp_path / "run" / "checkpoints" / "step-000001" / "trainer_state.pt").write_bytes(b"")
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f'env = "math/arith-v0"\nmodel = "{tiny_model_dir}"\nout_dir = "{tmp_path / "run"}"\n'
                      "train_tasks = 4\n[grpo]\nsteps = 2\n[eval]\nn = 1\n[eval.rollout.sampling]\nmax_tokens = 4\n")
    result = CliRunner().invoke(app, ["train", str(recipe)])
    assert result.exit_code == 1, result.output
    assert "trainer_state.pt does not read back" in " ".join(result.output.split()) and "Aborted" not in result.output


# ------------------------------------------------------------------------------------------------ losses


class Diverging:
    """A method whose first update's loss is NaN."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer, self.refills = model, optimizer, 0

    def keep(self, group):
        return True

    def train_step(self, kept, collected, step):
        return {"loss": float("nan"), "grad_norm": 1.0}

    def checkpoint_state(self, sharding):
        return {}, {}

    def restore(self, checkpoint, state):
        pass


def test_the_rl_loop_stops_at_a_non_finite_loss_naming_the_step(tiny_model_dir, tmp_path):
    model, optimizer = model_and_optimizer(tiny_model_dir)
    tokenizer = load_tokenizer(tiny_model_dir)
    cfg = loop.LoopConfig(steps=2, tasks_per_step=1, checkpoint_every=1, group_size=1, rollout=RolloutConfig(
        max_total_tokens=512, sampling=SamplingParams(max_tokens=4)))
    env = lambda: ArithmeticEnv(n_tasks=4)  # noqa: E731
    with pytest.raises(NonFiniteLoss, match=r"step 1: non-finite \{'loss': nan\}"):
        loop.run(cfg, Diverging(model, optimizer), tokenizer, HFPolicy(model, tokenizer), EnvEngines(env),
                 list(env().tasks), tmp_path)
    assert not (tmp_path / "checkpoints").exists()  # nothing NaN was saved or logged
    assert read_records(tmp_path / "metrics.jsonl") == []


def test_sft_stops_at_a_non_finite_loss_naming_the_step(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        next(model.parameters()).fill_(math.inf)
    with pytest.raises(NonFiniteLoss, match="SFT step 1"):
        sft(model, [trajectory()], SFTConfig(epochs=1))


# ------------------------------------------------------------------------------------------------- kills

KILL_CFG = GRPOConfig(steps=8, tasks_per_step=2, lr=1e-3, minibatch_size=4, checkpoint_every=1, group_size=4,
                      rollout=RolloutConfig(max_total_tokens=1024, sampling=SamplingParams(max_tokens=12)))


def train_tiny(model_dir, out_dir):
    """GRPO on the tiny model into `out_dir`, resuming from its latest checkpoint (run here, or in a subprocess)."""
    tokenizer, model = load_tokenizer(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)
    env = lambda: ArithmeticEnv(n_tasks=16)  # noqa: E731
    train(KILL_CFG, model, tokenizer, HFPolicy(model, tokenizer), env, list(env().tasks), Path(out_dir))


def checkpoints(out_dir):
    return len(list((out_dir / "checkpoints").glob("step-*[0-9]")))  # finished ones: not step-*.tmp


@pytest.mark.slow
def test_training_killed_at_random_points_resumes_to_the_uninterrupted_run(tiny_model_dir, tmp_path):
    started = time.perf_counter()
    train_tiny(tiny_model_dir, tmp_path / "straight")
    step_s = (time.perf_counter() - started) / KILL_CFG.steps  # a bound: it includes the start
    out, rng, kills = tmp_path / "killed", random.Random(0), 0
    script = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
              f"from test_checkpoint_crash import train_tiny; train_tiny({str(tiny_model_dir)!r}, sys.argv[1])")
    for _ in range(5):  # each run resumes the last one's checkpoints, and is killed at a random point of a step
        run, done = subprocess.Popen([sys.executable, "-c", script, str(out)]), checkpoints(out)
        while run.poll() is None and checkpoints(out) == done:  # a step's progress first
            time.sleep(0.05)
        time.sleep(rng.uniform(0, step_s))
        if run.poll() is not None:
            break
        run.send_signal(signal.SIGKILL)
        run.wait()
        kills += 1
    assert subprocess.run([sys.executable, "-c", script, str(out)]).returncode == 0
    assert kills >= 2

    straight, resumed = (read_records(d / "metrics.jsonl") for d in (tmp_path / "straight", out))
    assert [r["step"] for r in resumed] == list(range(1, KILL_CFG.steps + 1))  # no line lost or doubled
    for a, b in zip(straight, resumed):
        assert (a["mean_reward"], a["success"], a["sampled_tokens"]) == (b["mean_reward"], b["success"],
                                                                         b["sampled_tokens"])
        assert a.get("loss") == (pytest.approx(b["loss"], abs=1e-6) if "loss" in b else None)  # none: no signal
    final = [load_file(d / "checkpoints" / f"step-{KILL_CFG.steps:06d}" / "model.safetensors")
             for d in (tmp_path / "straight", out)]
    assert all(torch.allclose(final[0][k], final[1][k], atol=1e-5) for k in final[0])


def test_the_random_state_round_trips_and_gpu_states_need_their_gpus():
    import numpy as np

    from agentrl.trainers.checkpoint import rng_state, set_rng_state

    saved = rng_state()
    first = (random.random(), np.random.rand(), torch.rand(3))
    set_rng_state(saved)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])
    on_gpus = {**saved, "cuda": [torch.zeros(16, dtype=torch.uint8)] * 2}  # as a 2-GPU machine saved it
    with pytest.raises(CheckpointError, match="random state of 2 GPU"):
        set_rng_state(on_gpus)
