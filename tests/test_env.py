"""Env API, registry and the math env: Gymnasium's checker, validate(), rewards, corrective observations."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import agentrl
from agentrl.envs.math import ArithmeticEnv, calculator, outcome_reward, process_reward
from agentrl.envs.math.env import equations
from agentrl.envs.math.tasks import make_tasks
from agentrl.types import Message


def test_registry_lists_and_makes_math_env():
    assert "math/arith-v0" in agentrl.registry()
    env = agentrl.make("math/arith-v0", split="heldout", n_tasks=5)
    assert isinstance(env, ArithmeticEnv) and len(env.tasks) == 5 and env.split == "heldout"


def test_unknown_id_suggests_close_matches():
    with pytest.raises(KeyError, match=r"Did you mean 'math/arith-v0'.*Registered ids"):
        agentrl.make("math/arith-v1")


def test_register_rejects_bad_entry_points_and_conflicts():
    with pytest.raises(ValueError, match="package.module:Class"):
        agentrl.register("x/y-v0", "no_colon_here")
    with pytest.raises(ValueError, match="already registered"):
        agentrl.register("math/arith-v0", "somewhere.else:Env")


def test_third_party_registration_by_entry_point(tmp_path, monkeypatch):
    """An installed plugin (a real dist-info with an `agentrl.envs` entry point) registers its envs."""
    import agentrl.env.registry as registration

    (tmp_path / "my_plugin.py").write_text(
        "import agentrl\n"
        "def register():\n"
        "    agentrl.register('plugin/arith-v0', 'agentrl.envs.math:ArithmeticEnv', n_tasks=3)\n")
    dist = tmp_path / "my_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[agentrl.envs]\nmy_plugin = my_plugin:register\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registration, "_plugins_loaded", False)
    monkeypatch.setattr(registration, "_specs", dict(registration._specs))
    assert "plugin/arith-v0" in agentrl.registry()
    assert len(agentrl.make("plugin/arith-v0").tasks) == 3


@pytest.mark.parametrize("parser", ["hermes", "react"])
def test_check_passes_for_math_env(parser):
    assert agentrl.check("math/arith-v0", parser=parser) == []


def test_validate_reaches_max_reward_with_process_weight():
    env = agentrl.make("math/arith-v0", process_weight=0.5, n_tasks=20)
    assert env.max_reward == 1.5 and env.validate(n_tasks=20) == []


def test_tasks_are_deterministic_and_splits_disjoint():
    train, heldout = make_tasks("train", 500), make_tasks("heldout", 200)
    assert make_tasks("train", 500, 0) == train
    assert not {t.data["question"] for t in train} & {t.data["question"] for t in heldout}
    assert {t.data["kind"] for t in train} == {"expression", "word"}


def test_reset_picks_tasks_by_seed_and_accepts_a_task():
    env = agentrl.make("math/arith-v0")
    _, info_a = env.reset(seed=3)
    _, info_b = env.reset(seed=3)
    assert info_a == info_b
    task = env.tasks[7]
    obs, info = env.reset(options={"task": task})
    assert info["task_id"] == task.id and obs[-1] == Message("user", task.data["question"])
    with pytest.raises(TypeError, match="agentrl Task"):
        env.reset(options={"task": {"question": "1+1"}})


def test_rewards_and_corrective_observations():
    env = agentrl.make("math/arith-v0", max_invalid=2)
    env.reset(options={"task": env.tasks[0]})
    gold = env.tasks[0].data["answer"]
    obs, reward, terminated, truncated, info = env.step('<tool_call>\n{"name": "calc", "arguments": {}}\n</tool_call>')
    assert obs[0].role == "user" and "calculator" in obs[0].content and not terminated
    obs, reward, terminated, truncated, info = env.step("I am thinking")
    assert terminated and reward == 0 and "2 invalid actions" in info["reason"]
    env.reset(options={"task": env.tasks[0]})
    obs, reward, terminated, _, info = env.step(f"<answer> {gold} </answer>")
    assert terminated and reward == 1.0 and info["reward_components"]["outcome"] == 1.0
    env.reset(options={"task": env.tasks[0]})
    _, reward, terminated, _, _ = env.step(f"<answer>{gold}.0</answer>")
    assert terminated and reward == 0.0  # strict format: a plain integer


def test_calculator_and_verifiers():
    assert calculator.run({"expression": "3 * (4 + 5)"}) == "27"
    assert calculator.run({"expression": "7 / 2"}) == "3.5"
    assert calculator.run({"expression": "1 / 0"}).startswith("error: division by zero")
    assert calculator.run({"expression": "9 ** 99"}).startswith("error: exponents")
    assert calculator.run({"expression": "__import__('os')"}).startswith("error: unsupported syntax")
    assert outcome_reward(" 42 ", "42") == 1.0 and outcome_reward("42 apples", "42") == 0.0
    assert outcome_reward("-5", "-5") == 1.0
    # 3 equations, 2 true; "x = 4" has no arithmetic on the left and is not an equation.
    assert process_reward(["3 + 4 = 7, so (7 * 2 = 14)", "then 14 - 1 = 12 and x = 4"]) == pytest.approx(2 / 3)
    assert equations("so (3 + 4 = 7)") == [("3 + 4", "7")]
    assert process_reward(["no equations here"]) == 0.0


adversarial = st.one_of(
    st.text(max_size=300),
    st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", '"name"', '"arguments"', ":", "calculator",
                              '"expression"', "<answer>", "</answer>", "=", "1", "+", "(", ")", "9" * 30, "\n",
                              "Action:", "[", "]", "**", "/0"]), max_size=60).map("".join),
)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=st.lists(adversarial, min_size=1, max_size=4))
def test_fuzz_math_env_never_raises(actions):
    env = ArithmeticEnv(n_tasks=4)
    env.reset(seed=0)
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(action)
        assert env.observation_space.contains(obs) and isinstance(reward, float)
        env.assistant_message(action)
        if terminated or truncated:
            break

