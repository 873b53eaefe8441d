"""The shared part of adapters whose tasks are seeds (Gymnasium, TextArena, OpenEnv): the task list, and the
gold solution as an optional scripted solver that plays live, each move from the env's state at that turn."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

from agentrl.env.api import TextEnv
from agentrl.types import Task

HELDOUT_SEED_OFFSET = 1_000_000  # the train split plays seeds from 0, any other split seeds from here


class SeededEnv(TextEnv):
    """A `TextEnv` whose tasks are the seeds `0..n_tasks-1` (train) or from `HELDOUT_SEED_OFFSET` (other splits)."""

    task_prefix: str = ""  # task ids are "<task_prefix>/<seed>"
    solver_signature: str = ""  # what `solver` takes, for the error when there is none

    def __init__(self, split: str, max_turns: int, n_tasks: int, solver: Callable[..., Any] | None):
        super().__init__(split=split, max_turns=max_turns)
        self.n_tasks, self.solver = n_tasks, solver

    def load_tasks(self, split: str) -> Sequence[Task]:
        """`n_tasks` tasks `"<task_prefix>/<seed>"`, with `seed` and `index` in their data."""
        offset = 0 if split == "train" else HELDOUT_SEED_OFFSET
        return [Task(f"{self.task_prefix}/{offset + i}", {"seed": offset + i, "index": i})
                for i in range(self.n_tasks)]

    def solver_inputs(self) -> tuple:
        """What the solver reads this turn."""
        raise NotImplementedError

    def gold_actions(self, task: Task) -> Iterator[str]:
        """The solver's moves: a generator, so that validate() asks for each one after the previous step."""
        if self.solver is None:
            raise NotImplementedError(f"{self.task_prefix} has no gold solution: pass solver={self.solver_signature}")
        while True:
            yield str(self.solver(*self.solver_inputs()))
