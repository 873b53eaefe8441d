"""Every seed a run draws, from the run's one seed down to each turn's sampling seed.

    step seed    step_seed(seed, step)                   the rollout seed of a training step (synchronous training)
    env seed     episode_seed(seed, position)            the task at `position` of a stream; shared by its group
    sample seed  sample_seed(env_seed, group_size, k)    sample k of that group
    turn seed    turn_seed(sample_seed, turn)            the sampling seed of one turn (of one call, in a session)
    eval seed    eval_seed(seed, entry, position)        task `position` of suite entry `entry`, in an evaluation

Each is `outer * stride + inner`, so that two different (outer, inner) pairs never share a seed while `inner` stays
below the stride. Seeds come from positions, never from the order in which episodes happen to run: a resumed, sharded
or asynchronous run plays every task with the seeds an uninterrupted one would. The strides are the numbers the first
runs used: other numbers would play other episodes, and no earlier run could be replayed.
"""

from __future__ import annotations

STRIDE = 100_003  # steps per run seed; tasks of a stream per seed
WIDE_STRIDE = 1_000_003  # turns per sample seed (calls per session); tasks per suite entry in an evaluation
ENTRIES = 1_000  # suite entries per seed in an evaluation


def step_seed(seed: int, step: int) -> int:
    """The rollout seed of training step `step` of a run seeded `seed`: its tasks' env seeds derive from it, so that
    each step draws afresh and a resumed run draws what the interrupted one would have."""
    return seed * STRIDE + step


def episode_seed(seed: int, position: int) -> int:
    """The env seed of the task at `position` of a stream seeded `seed`: every sample of its group resets the env with
    it, so that the group's samples differ by the policy's choices alone."""
    return seed * STRIDE + position


def sample_seed(env_seed: int, group_size: int, k: int) -> int:
    """The seed of sample `k` (of `group_size`) of the group played from `env_seed`: distinct within the group, and
    from every other group's (their env seeds differ)."""
    return env_seed * group_size + k


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of `turn` of the sample seeded `seed` (of call number `turn`, in a gateway session): each
    turn draws afresh, and the same seeds sample the same episode again."""
    return seed * WIDE_STRIDE + turn


def eval_seed(seed: int, entry: int, position: int) -> int:
    """The env seed of task `position` of suite entry `entry` (its index in the suite) in an evaluation seeded `seed`:
    it depends on nothing else, so that a resumed evaluation samples exactly what an uninterrupted one would."""
    return (seed * ENTRIES + entry) * WIDE_STRIDE + position
