"""Generator–verifier co-training: judgements, the reward schedule, the verifier env, agreement."""

import asyncio

import pytest

from agentrl.envs.math import ArithmeticEnv
from gymnasium.utils.env_checker import check_env
from agentrl.rollout.engine import RolloutConfig, RolloutEngine
from agentrl.policy.scripted import ScriptedPolicy, playing
from agentrl.trainers.methods.tango import (Judgement, VerifierEnv, agreement, combined_reward, format_judgement,
                                    parse_judgement, process_weight, step_share, trajectory_steps,
                                    verification_task)


def test_judgements_parse_and_round_trip():
    j = parse_judgement("Step 1: correct\nstep 2 : INCORRECT\nStep 1: incorrect\nVerdict: correct\n")
    assert j == Judgement({1: True, 2: False}, True)  # the first verdict per step counts
    assert parse_judgement("Step 1: correct") == Judgement({1: True}, None)  # no final verdict: malformed
    assert parse_judgement(format_judgement([True, False, True], False)) == Judgement({1: True, 2: False, 3: True},
                                                                                      False)
    assert step_share(Judgement({1: True, 3: True}, True), 4) == 0.5  # step 2 and 4 unjudged: incorrect


def test_process_weight_schedule_and_combined_reward():
    assert [process_weight(s, 5, 0.5, 0.0) for s in range(5)] == pytest.approx([0.5, 0.375, 0.25, 0.125, 0.0])
    assert process_weight(0, 1, 0.5, 0.1) == 0.5
    assert combined_reward(outcome=1.0, process=0.5, alpha=0.3) == pytest.approx(0.3 * 0.5 + 0.7 * 1.0)
    assert combined_reward(outcome=0.0, process=1.0, alpha=0.0) == 0.0


def test_math_env_process_checker_judges_one_step():
    env = ArithmeticEnv(n_tasks=1)
    assert env.check_step("3 + 4 = 7\nFinal Answer: 7") is True
    assert env.check_step("2 * 3 = 6, then 6 + 1 = 8") is False
    assert env.check_step('{"name": "calculator", "arguments": {"expression": "3 + 4"}}') is None


def generator_episodes(renderer, wrong: bool):
    """Math episodes of an expert; with `wrong`, one that skips the calculator and writes a false equation."""
    env = ArithmeticEnv(n_tasks=3, parser="react")
    tasks = list(env.tasks)
    scripts = {t.data["question"]: (env.gold_actions(t) if not wrong else
                                    [f"{t.data['solution']} = 999\nFinal Answer: 999"]) for t in tasks}
    engine = RolloutEngine(lambda: ArithmeticEnv(n_tasks=3, parser="react"),
                           ScriptedPolicy(renderer, playing(scripts), renderer.generation_prompt), renderer,
                           RolloutConfig())
    groups = asyncio.run(engine.run(tasks))
    engine.close()
    return tasks, [g.trajectories[0] for g in groups]


def test_verifier_tasks_show_each_step_and_carry_outcome_and_checker(renderer):
    env = ArithmeticEnv(n_tasks=3, parser="react")
    tasks, good = generator_episodes(renderer, wrong=False)
    steps = trajectory_steps(good[0], renderer)
    assert steps == [(env.gold_actions(tasks[0])[0], tasks[0].data["answer"]), (env.gold_actions(tasks[0])[1], "")]
    task = verification_task(good[0], tasks[0].data["question"], renderer, env.check_step, 0)
    assert task.data["outcome"] is True and task.data["checker"] == [None, True]
    assert task.data["question"].startswith(f"Problem: {tasks[0].data['question']}\nStep 1: Action: calculator[")
    _, bad = generator_episodes(renderer, wrong=True)
    task = verification_task(bad[0], tasks[0].data["question"], renderer, env.check_step, 1)
    assert task.data["outcome"] is False and task.data["checker"] == [False]


def test_verifier_env_passes_the_checks_and_scores_the_final_verdict(renderer):
    env_math = ArithmeticEnv(n_tasks=3, parser="react")
    tasks = []
    for wrong in (False, True):
        problems, trajectories = generator_episodes(renderer, wrong)
        tasks += [verification_task(t, p.data["question"], renderer, env_math.check_step, i)
                  for i, (t, p) in enumerate(zip(trajectories, problems))]
    env = VerifierEnv(tasks)
    check_env(env, skip_render_check=True)
    assert env.validate(len(tasks)) == []
    env.reset(seed=0, options={"task": tasks[0]})  # a correct trajectory
    assert env.step("Step 1: incorrect\nStep 2: incorrect\nVerdict: correct")[1] == 1.0  # outcome only
    env.reset(seed=0, options={"task": tasks[0]})
    assert env.step("Step 1: correct\nStep 2: correct")[1] == 0.0  # no final verdict
    env.reset(seed=0, options={"task": tasks[0]})
    assert env.step("Step 1: correct\nVerdict: correct")[1] == 0.0  # step 2 not judged
    # agreement counts only steps the checker can judge: here step 2 of the good ones, step 1 of the bad
    judgements = [parse_judgement(format_judgement([True, True], True))] * 3 + \
                 [parse_judgement(format_judgement([True], False))] * 3
    assert agreement(tasks, judgements) == 0.5
    assert [VerifierEnv(tasks).demonstration(t, None)[0].splitlines()[-1] for t in (tasks[0], tasks[3])] == \
           ["Verdict: correct", "Verdict: incorrect"]
