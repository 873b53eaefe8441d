"""The curriculum (`trainers/tasks.py`): pools by measured pass rate, each step's shares of them, promotion and
demotion as rates move, a resumed run drawing what the uninterrupted one would, and the loop running it."""

import json

import pytest

from agentrl.config import ConfigError, load_config
from agentrl.trainers.job.pipeline import run
from agentrl.trainers.job.recipe import TrainJob
from agentrl.trainers.loop import LoopConfig
from agentrl.trainers.tasks import Curriculum, CurriculumConfig
from agentrl.types import Group, StopReason, Task, Trajectory

TASKS = [Task(f"t{i}") for i in range(10)]
SHARES = CurriculumConfig(easy_share=0.2, hard_share=0.2, decay=0.5)


def group(task: Task, successes: int, size: int = 4) -> Group:
    def episode(won: bool) -> Trajectory:
        return Trajectory(task.id, (1, 2), (0, 1), (0.0, -0.5), 1, (), reward=float(won))
    return Group(task, tuple(episode(i < successes) for i in range(size)))


def test_unplayed_tasks_are_in_the_middle_pool_and_a_step_draws_distinct_ones():
    curriculum = Curriculum(TASKS, seed=0, cfg=SHARES)
    drawn = curriculum.take(8)
    assert len({t.id for t in drawn}) == 8 and {curriculum.pool(t) for t in TASKS} == {"middle"}
    assert curriculum.observe([], 1.0)["curriculum"]["middle"] == {"tasks": 10, "drawn": 8, "pass_rate": None}


def test_pools_follow_pass_rates_and_each_step_takes_their_shares():
    curriculum = Curriculum(TASKS, seed=0, cfg=SHARES)
    # t0-t2 always solved, t3-t5 never, t6 half the time; t7-t9 not played yet
    metrics = curriculum.observe([group(t, 4) for t in TASKS[:3]] + [group(t, 0) for t in TASKS[3:6]]
                                 + [group(TASKS[6], 2)], max_reward=1.0)["curriculum"]
    assert {name: pool["tasks"] for name, pool in metrics.items()} == {"easy": 3, "middle": 4, "hard": 3}
    assert metrics["easy"]["pass_rate"] == 1.0 and metrics["hard"]["pass_rate"] == 0.0
    assert metrics["middle"]["pass_rate"] == 0.5  # t6 only: the unplayed have no rate
    for _ in range(3):  # every draw: 1 easy and 1 hard of 5 (20% each), the rest from the middle
        pools = [curriculum.pool(t) for t in curriculum.take(5)]
        assert sorted(pools) == ["easy", "hard", "middle", "middle", "middle"]
    # a pool that runs short is filled from the others, middle first: 10 tasks, all drawn once
    assert sorted(t.id for t in curriculum.take(10)) == sorted(t.id for t in TASKS)


def test_tasks_are_promoted_and_demoted_as_their_rates_move():
    curriculum = Curriculum(TASKS, seed=0, cfg=SHARES)
    curriculum.observe([group(TASKS[0], 0), group(TASKS[1], 4)], 1.0)
    assert (curriculum.pool(TASKS[0]), curriculum.pool(TASKS[1])) == ("hard", "easy")
    curriculum.observe([group(TASKS[0], 4), group(TASKS[1], 0)], 1.0)  # decay 0.5: both rates are now 0.5
    assert curriculum.rates == {"t0": 0.5, "t1": 0.5}
    assert (curriculum.pool(TASKS[0]), curriculum.pool(TASKS[1])) == ("middle", "middle")
    errors = Group(TASKS[2], (Trajectory("t2", (1,), (0,), (0.0,), 1, (), 0.0, stop=StopReason.ENV_ERROR),))
    curriculum.observe([errors], 1.0)  # no valid episode: no rate
    assert "t2" not in curriculum.rates


def test_a_resumed_curriculum_draws_what_the_uninterrupted_one_would():
    straight = Curriculum(TASKS, seed=3, cfg=SHARES)
    straight.take(4)
    straight.observe([group(t, 4 * (i % 2)) for i, t in enumerate(TASKS[:6])], 1.0)
    saved = straight.state()
    assert saved["data_position"] == 4 and saved["curriculum"]["draws"] == 4
    resumed = Curriculum(TASKS, seed=3, cfg=SHARES, state=json.loads(json.dumps(saved["curriculum"])))
    assert [t.id for t in resumed.take(5)] == [t.id for t in straight.take(5)]


def test_settings_that_cannot_work_are_refused():
    for bad, words in (({"easy_above": 0.1, "hard_below": 0.5}, "hard_below < easy_above"),
                       ({"easy_share": 0.7, "hard_share": 0.5}, "sum to at most 1"), ({"decay": 1.0}, "decay")):
        with pytest.raises(ValueError, match=words):
            CurriculumConfig(**bad)
    with pytest.raises(ValueError, match="remove max_staleness or the curriculum"):
        LoopConfig(curriculum=CurriculumConfig(), max_staleness=1)


@pytest.mark.slow
def test_the_loop_draws_by_the_curriculum_and_resumes_it(tiny_model_dir, tmp_path):
    """Two steps of GRPO with a curriculum: each step logs its pools, the checkpoint keeps the pass rates, and a run
    killed after step 1 resumes to the same second step."""
    rollout = {"max_total_tokens": 512, "sampling": {"max_tokens": 8}}
    grpo = {"steps": 2, "tasks_per_step": 4, "group_size": 2, "minibatch_size": 8, "rollout": rollout,
            "reward": {"terms": {"env": 1.0, "random": 0.5}}, "curriculum": {"easy_share": 0.25, "hard_share": 0.25},
            "checkpoint_every": 1}

    def train(out, steps):
        run(load_config(TrainJob, {"env": "math/arith-v0", "model": str(tiny_model_dir), "out_dir": str(out),
                                   "train_tasks": 6, "env_kwargs": {"parser": "react", "max_turns": 2}, "eval": None,
                                   "grpo": {**grpo, "steps": steps}}), log=lambda _: None)
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    straight = train(tmp_path / "straight", 2)
    pools = straight[0]["curriculum"]
    assert sum(p["tasks"] for p in pools.values()) == 6 and sum(p["drawn"] for p in pools.values()) == 4
    train(tmp_path / "resumed", 1)
    resumed = train(tmp_path / "resumed", 2)
    assert resumed[1]["curriculum"] == straight[1]["curriculum"]
    assert resumed[1]["mean_reward"] == straight[1]["mean_reward"]
    with pytest.raises(ConfigError, match="curriculum"):
        load_config(TrainJob, {"env": "math/arith-v0", "model": str(tiny_model_dir),
                               "grpo": {"curriculum": {"decay": 2}}})
