"""The CLI end to end: envs list/show/check, model init, and a 64-episode rollout with the tiny model."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentrl.cli.common import console
from agentrl.cli.main import app
from agentrl.rollout.jsonl import read_jsonl
from agentrl.types import Status

runner = CliRunner()


def test_envs_list_show_check():
    listed = runner.invoke(app, ["envs", "list"])
    assert listed.exit_code == 0 and "math/arith-v0" in listed.output
    shown = runner.invoke(app, ["envs", "show", "math/arith-v0"])
    assert shown.exit_code == 0 and "calculator" in shown.output
    checked = runner.invoke(app, ["envs", "check", "math/arith-v0"])
    assert checked.exit_code == 0 and "check_env passed" in checked.output
    unknown = runner.invoke(app, ["envs", "check", "math/arith"])
    assert unknown.exit_code == 2 and "Did you mean 'math/arith-v0'" in unknown.output
    missing = runner.invoke(app, ["envs", "check", "verifiers/env-v0"])
    assert missing.exit_code == 2 and "'environment'" in missing.output and "--kwargs" in missing.output
    kwargs = '{"environment": "agentrl.envs.math.adapted", "env_args": {"kind": "guess"}}'
    checked = runner.invoke(app, ["envs", "check", "verifiers/env-v0", "--n-tasks", "2", "--kwargs", kwargs])
    assert checked.exit_code == 0 and "check_env passed" in checked.output


@pytest.mark.slow
def test_rollout_64_episodes_with_tiny_model(tiny_model_dir, tmp_path):
    out = tmp_path / "rollout.jsonl"
    result = runner.invoke(app, ["rollout", "--env", "math/arith-v0", "--model", str(tiny_model_dir), "--n", "32",
                                 "--group-size", "2", "--max-tokens", "16", "--out", str(out)])
    assert result.exit_code == 0, result.output
    lines = out.read_text().splitlines()
    assert len(lines) == 64 and all(json.loads(line)["task_id"].startswith("math-train-") for line in lines)
    trajectories = read_jsonl(out)
    for t in trajectories:
        assert t.status is not Status.ERROR, t.reason
        assert sum(t.loss_mask) == sum(turn.end - turn.start for turn in t.turns) > 0
        assert all(lp <= 0 for lp, m in zip(t.logprobs, t.loss_mask) if m)
    assert "episodes_per_s" in result.output


def test_compare_training_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(console, "width", 200)  # one table row per run (COLUMNS is read when the console is made)

    def held_out(successes, n=200):
        return {"episodes": n, "valid": n, "successes": successes, "success": successes / n}

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "summary.json").write_text(json.dumps(
        {"method": "grpo (judge 1 [transformers])", "rl_seconds": 306.0, "before": held_out(121), "after": held_out(155)}))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "summary.json").write_text(json.dumps(
        {"method": "tandem", "before": held_out(121), "after": {**held_out(145), "handoff": {"p=0.5": 0.665}}}))
    result = runner.invoke(app, ["compare", str(tmp_path / "a"), str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    row = next(line for line in lines if "grpo" in line)
    # 121/200 -> Wilson [0.54, 0.67]; 155/200 -> [0.71, 0.83]; difference +0.170, Newcombe [+0.08, +0.26]
    assert "[transformers])" in result.output  # a method's brackets are text, not rich markup
    for text in ("0.605 [0.54, 0.67]", "0.775 [0.71, 0.83]", "+0.170 [+0.08, +0.26]", "5.1"):
        assert text in row, (text, row)
    assert "p=0.5 0.665" in next(line for line in lines if "tandem" in line)
    missing = runner.invoke(app, ["compare", str(tmp_path)])
    assert missing.exit_code == 2 and "no summary.json" in missing.output
    (tmp_path / "old").mkdir()  # rates without their counts: refused, not rebuilt from the rate
    (tmp_path / "old" / "summary.json").write_text(json.dumps({"before": {"success": 0.6}, "after": {"success": 0.7}}))
    old = runner.invoke(app, ["compare", str(tmp_path / "old")])
    assert old.exit_code == 2 and "predates stored held-out counts" in old.output


def test_compare_pools_held_out_suites_and_pairs_their_tasks(tmp_path, monkeypatch):
    from agentrl.rollout.jsonl import write_jsonl
    from agentrl.types import Trajectory

    monkeypatch.setattr(console, "width", 220)
    run = tmp_path / "search"
    # split x: tasks 0-9, solved before {0, 1, 2}, after {0, 3, 4, 5, 6}; split y: 0-9, before {0}, after {0, 1}.
    # The same task id in two splits is two tasks. Gained 3, 4, 5, 6 and y's 1; lost 1 and 2.
    solved = {"before_RL": {"x": {0, 1, 2}, "y": {0}}, "after_RL": {"x": {0, 3, 4, 5, 6}, "y": {0, 1}}}
    for label, splits in solved.items():
        write_jsonl([Trajectory(f"t{i}", (1,), (0,), (0.0,), 1, (), float(i in ids),
                                metrics={"success": i in ids}, logs={"split": split})
                     for split, ids in splits.items() for i in range(10)],
                    run / "heldout" / label / "trajectories.jsonl")

    def held_out(label):  # what `heldout_metrics` stores: the pooled counts (its rates are not read)
        successes = sum(len(ids) for ids in solved[label].values())
        return {"success": successes / 20, "successes": successes, "valid": 20, "episodes": 20}

    (run / "summary.json").write_text(json.dumps({"method": "grpo", "before": held_out("before_RL"),
                                                  "after": held_out("after_RL")}))
    result = runner.invoke(app, ["compare", str(run)])
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if "grpo" in line)
    # pooled: 4/20 -> 7/20 (Wilson [0.08, 0.42], [0.18, 0.57]); paired: +5 / -2, p = 2 * (1 + 7 + 21) / 128
    for text in ("0.200 [0.08, 0.42]", "0.350 [0.18, 0.57]", "+0.150", "+5 / -2 (p=0.45)"):
        assert text in row, (text, row)


def test_baselines_table_pairs_every_row_with_one_and_gives_each_suite(tmp_path):
    from agentrl.rollout.jsonl import write_jsonl
    from agentrl.types import StopReason, Trajectory

    # Same ten tasks per suite. SFT: x {0, 1, 2}, y {0}; GRPO: x {0, 3, 4, 5, 6}, y {0, 1}, and y's task 9 an error
    # (left out: y has 9 tasks). RAG: x {0, 1}, y none.
    solved = {"SFT": {"x": {0, 1, 2}, "y": {0}}, "GRPO": {"x": {0, 3, 4, 5, 6}, "y": {0, 1}},
              "RAG": {"x": {0, 1}, "y": set()}}
    for name, splits in solved.items():
        write_jsonl([Trajectory(f"t{i}", (1,), (0,), (0.0,), 1, (), float(i in ids),
                                stop=StopReason.ENV_ERROR if (name, split, i) == ("GRPO", "y", 9)
                                else StopReason.TERMINATED,
                                metrics={"success": i in ids}, logs={"split": split})
                     for split, ids in splits.items() for i in range(10)], tmp_path / name / "trajectories.jsonl")
    table_md = tmp_path / "table.md"
    result = runner.invoke(app, ["baselines", *(f"{n}={tmp_path / n}" for n in solved), "--against", "SFT",
                                 "--out", str(table_md)])
    assert result.exit_code == 0, result.output
    rows = {line.split("|")[1].strip(): line for line in table_md.read_text().splitlines()[2:]}
    # x: 3/10 -> Wilson [0.11, 0.60]; y: 1/10 -> [0.02, 0.40]; GRPO y 2/9 -> [0.06, 0.55]; mean (0.5 + 2/9) / 2
    for text in ("0.300 [0.11, 0.60] (n=10)", "0.100 [0.02, 0.40] (n=10)", "| 0.200 |", "reference"):
        assert text in rows["SFT"], (text, rows["SFT"])
    # paired with SFT on 19 tasks: gained x 3, 4, 5, 6 and y 1, lost x 1, 2: p = 2 * (1 + 7 + 21) / 128
    for text in ("0.500 [0.24, 0.76] (n=10)", "0.222 [0.06, 0.55] (n=9)", "| 0.361 |", "+5 / -2 (p=0.45) on 19"):
        assert text in rows["GRPO"], (text, rows["GRPO"])
    assert "+0 / -2 (p=0.5) on 20" in rows["RAG"]  # lost x's 2 and y's 0
    missing = runner.invoke(app, ["baselines", f"SFT={tmp_path / 'SFT'}", "--against", "RAG"])
    assert missing.exit_code == 2 and "names no row" in missing.output
    bad = runner.invoke(app, ["baselines", str(tmp_path / "SFT"), "--against", "SFT"])
    assert bad.exit_code == 2 and "NAME=DIR" in bad.output


def test_train_set_overrides_any_recipe_key(tmp_path):
    from agentrl.cli.common import parse_sets
    from agentrl.config import ConfigError

    assert parse_sets(["grpo.lr=1e-4", "grpo.rollout.max_turns=4", "env=math/arith-v0", "eval.split=[\"a\"]"]) == {
        "grpo": {"lr": 1e-4, "rollout": {"max_turns": 4}}, "env": "math/arith-v0", "eval": {"split": ["a"]}}
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_sets(["grpo.lr"])
    recipe = tmp_path / "r.toml"
    recipe.write_text('env = "math/arith-v0"\nmodel = "m"\n')
    wrong = CliRunner().invoke(app, ["train", str(recipe), "--set", "grpo.no_such_key=1"])
    assert wrong.exit_code == 2 and "grpo.no_such_key" in wrong.output


def test_train_names_a_model_directory_that_is_not_there():
    recipe = Path(__file__).parents[1] / "recipes" / "cpu_math_rent_train.toml"
    for args in (["train", str(recipe), "--set", 'model="runs/nowhere/sft_model"'],
                 ["train", str(recipe), "--model", "./nowhere", "--dry-run"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and "No model directory at" in result.output, result.output
        assert "cpu_math_warmstart_train.toml" in result.output


def test_train_unset_removes_a_recipe_table_and_names_a_missing_key():
    from agentrl.config import ConfigError, load_config
    from agentrl.trainers.losses import CorrectionConfig
    from agentrl.trainers.job.recipe import TrainJob

    recipe = Path(__file__).parents[1] / "recipes" / "cpu_demo_async_train.toml"
    assert load_config(TrainJob, recipe).grpo.correction.tis == "token"
    uncorrected = load_config(TrainJob, recipe, {"grpo": {"max_staleness": 4}}, unset=["grpo.correction"])
    assert uncorrected.grpo.correction == CorrectionConfig() and uncorrected.grpo.max_staleness == 4
    assert load_config(TrainJob, recipe, unset=["grpo.correction.tis"]).grpo.correction.decoupled
    with pytest.raises(ConfigError, match="--unset grpo.no_such_table: .* has no such key"):
        load_config(TrainJob, recipe, unset=["grpo.no_such_table"])


def test_a_chat_template_that_does_not_exist_stops_every_job_at_start_up(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('env = "math/arith-v0"\nmodel = "m"\nchat_template = "chatml-tool"\n')
    for args in (["train", str(recipe)], ["eval", "--suite", "math/heldout", "--model", "m", "--chat-template",
                                          "chatml-tool"],
                 ["rollout", "--env", "math/arith-v0", "--model", "m", "--chat-template", "chatml-tool"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and "chatml-tool" in result.output and "chatml-tools" in result.output, args


def test_train_and_eval_stop_before_any_model_loads_when_docker_does_not_answer(tiny_model_dir, tmp_path,
                                                                                 monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-daemon.sock")
    recipe = Path(__file__).parents[1] / "recipes" / "cpu_smollm2_code_train.toml"
    trained = runner.invoke(app, ["train", str(recipe), "--set", f'model="{tiny_model_dir}"',
                                  "--set", f'out_dir="{tmp_path / "run"}"', "--set", 'chat_template="chatml-tools"'])
    assert trained.exit_code == 1 and "no Docker daemon answers" in trained.output, trained.output
    assert "start-dockerd.sh" in trained.output and not (tmp_path / "run" / "sft_model").exists()
    suite = tmp_path / "suite.toml"
    suite.write_text('name = "code-docker"\nversion = 0\n[[entries]]\nenv = "code/generated-v0"\nsplit = "heldout"\n'
                     'n_tasks = 2\n')
    evaluated = runner.invoke(app, ["eval", "--suite", str(suite), "--model", str(tiny_model_dir),
                                    "--engine", "transformers", "--out", str(tmp_path / "eval")])
    assert evaluated.exit_code == 1 and "no Docker daemon answers" in evaluated.output, evaluated.output
    assert not (tmp_path / "eval").exists()
