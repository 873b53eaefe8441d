"""The CLI end to end: envs list/show/check, model init, and a 64-episode rollout with the tiny model."""

import json

import pytest
from typer.testing import CliRunner

from agentrl.cli import app
from agentrl.rollout import read_jsonl
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
