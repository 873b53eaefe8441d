"""Which tasks each step of the RL loop plays: `TaskStream`, every task in a seeded order, reshuffled each pass (the
default), or a `Curriculum`, by measured difficulty (`[grpo.curriculum]`).

Uniform sampling wastes steps on tasks the policy always solves or never does: their groups' rewards do not vary,
so GRPO's advantages are 0 and the step trains nothing on them. A `Curriculum` keeps each task's pass rate (an
exponential moving average of its groups' success, `decay` the weight of the old value) and three pools: easy (rate
above `easy_above`), hard (below `hard_below`) and the rest, where tasks not played yet start. Each step draws at most
`easy_share` and `hard_share` of its tasks from the easy and hard pools and the rest from the middle one, filling
from the others when a pool runs short; tasks move between pools as their rates move (promotion and demotion). The
rates and the number of draws are the checkpoint's `curriculum` state: a resumed run draws what the uninterrupted one
would have.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

from pydantic import with_config

from agentrl.config import STRICT
from agentrl.eval.metrics import is_success
from agentrl.types import Group, Task

POOLS = ("easy", "middle", "hard")


@with_config(STRICT)
@dataclass(frozen=True)
class CurriculumConfig:
    """`[grpo.curriculum]`: the pools' bounds, their shares of each step's tasks, and how fast pass rates move."""

    easy_above: float = 0.9  # a task whose pass rate is above this is easy
    hard_below: float = 0.1  # ... below this, hard
    easy_share: float = 0.1  # of each step's tasks, at most this share from the easy pool
    hard_share: float = 0.2  # ... and this share from the hard pool; the rest from the middle one
    decay: float = 0.5  # a task's pass rate after a group: decay × the old rate + (1 - decay) × the group's

    def __post_init__(self) -> None:
        problems = []
        if not 0 <= self.hard_below < self.easy_above <= 1:
            problems.append(f"needs 0 <= hard_below < easy_above <= 1, got {self.hard_below} and {self.easy_above}")
        if not (0 <= self.easy_share and 0 <= self.hard_share and self.easy_share + self.hard_share <= 1):
            problems.append(f"easy_share and hard_share must be >= 0 and sum to at most 1, got {self.easy_share} "
                            f"and {self.hard_share}")
        if not 0 <= self.decay < 1:
            problems.append(f"decay must be in [0, 1) (0: the last group's rate alone), got {self.decay}")
        if problems:
            raise ValueError("invalid curriculum: " + "; ".join(problems))


class TaskStream:
    """Tasks in a seeded order, reshuffled each pass; `position` is the data position saved in checkpoints."""

    def __init__(self, tasks: list[Task], seed: int, position: int = 0):
        self.tasks, self.seed, self.position = tasks, seed, position
        self._pass: tuple[int, list[int]] = (-1, [])  # the last pass's order, as (epoch, order)

    def _order(self, epoch: int) -> list[int]:
        if self._pass[0] != epoch:
            order = list(range(len(self.tasks)))
            random.Random(self.seed * 7919 + epoch).shuffle(order)
            self._pass = (epoch, order)
        return self._pass[1]

    def at(self, position: int) -> Task:
        """The task at `position` of the stream."""
        epoch, i = divmod(position, len(self.tasks))
        return self.tasks[self._order(epoch)[i]]

    def take(self, n: int) -> list[Task]:
        """The next `n` tasks, continuing into the next pass (a new order) when this one runs out."""
        out = [self.at(p) for p in range(self.position, self.position + n)]
        self.position += n
        return out

    def observe(self, groups: Sequence[Group], max_reward: float) -> dict[str, Any]:
        """Nothing: the order does not depend on the episodes (a `Curriculum`'s does)."""
        return {}

    def state(self) -> dict[str, Any]:
        """The data position a checkpoint keeps."""
        return {"data_position": self.position}


class Curriculum:
    """A task stream (`take`, `position`, like `TaskStream`) that draws each step's tasks from difficulty pools,
    and learns the pools from the groups played (`observe`)."""

    def __init__(self, tasks: list[Task], seed: int, cfg: CurriculumConfig, state: dict[str, Any] | None = None):
        self.tasks, self.seed, self.cfg = tasks, seed, cfg
        state = state or {}
        self.rates: dict[str, float] = dict(state.get("rates", {}))  # task id -> pass rate, for the tasks played
        self.position: int = state.get("draws", 0)  # tasks drawn so far: seeds the next draw
        self.drawn = Counter()  # tasks drawn per pool since the last `observe`

    def pool(self, task: Task) -> str:
        """The pool `task` is in now: easy, middle (where unplayed tasks are) or hard."""
        rate = self.rates.get(task.id)
        if rate is None or self.cfg.hard_below <= rate <= self.cfg.easy_above:
            return "middle"
        return "easy" if rate > self.cfg.easy_above else "hard"

    def take(self, n: int) -> list[Task]:
        """`n` tasks (distinct while the tasks last): the easy and hard pools' shares, the rest from the middle pool,
        a short pool filled from the others (the middle first)."""
        rng = random.Random(self.seed * 7919 + self.position)
        pools = {name: [] for name in POOLS}
        for task in self.tasks:
            pools[self.pool(task)].append(task)
        for tasks in pools.values():
            rng.shuffle(tasks)
        want = {"easy": round(self.cfg.easy_share * n), "hard": round(self.cfg.hard_share * n)}
        drawn = Counter({name: min(want[name], len(pools[name])) for name in ("easy", "hard")})
        for name in ("middle", "hard", "easy"):  # the rest: the middle pool, then whatever is left
            drawn[name] += min(n - sum(drawn.values()), len(pools[name]) - drawn[name])
        out = [pools[name][i] for name in POOLS for i in range(drawn[name])]
        self.drawn.update(drawn)
        out += [rng.choice(self.tasks) for _ in range(n - len(out))]  # fewer tasks than asked: repeat some
        self.position += n
        return out

    def observe(self, groups: Sequence[Group], max_reward: float) -> dict[str, Any]:
        """Each group's success rate (over its valid episodes) into its task's pass rate; returns the step's metrics:
        each pool's size and mean pass rate after the update (unplayed tasks count in the middle pool's size, not its
        rate), and the tasks drawn from it since the last call."""
        for group in groups:
            if not group.valid:
                continue
            rate = sum(is_success(t, max_reward) for t in group.valid) / len(group.valid)
            old = self.rates.get(group.task.id)
            self.rates[group.task.id] = rate if old is None else self.cfg.decay * old + (1 - self.cfg.decay) * rate
        out: dict[str, Any] = {}
        for name in POOLS:
            members = [t for t in self.tasks if self.pool(t) == name]
            rates = [self.rates[t.id] for t in members if t.id in self.rates]
            out[name] = {"tasks": len(members), "drawn": self.drawn[name],
                         "pass_rate": sum(rates) / len(rates) if rates else None}
        self.drawn = Counter()
        return {"curriculum": out}

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the draws (as the data position) and the pass rates."""
        return {"data_position": self.position, "curriculum": {"rates": dict(self.rates), "draws": self.position}}
