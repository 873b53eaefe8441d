"""Tutorial: a tool-using environment of your own, registered by id, checked, and rolled out.

    python examples/tutorials/custom_env.py [--model DIR]

A warehouse holds items on shelves; the agent counts an item with the `count` tool, shelf by shelf, and
answers the total. Without --model the tiny model is built into ~/.cache/agentrl/models/tiny.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from pathlib import Path

# --8<-- [start:env]
import agentrl
from agentrl import Message, Task, ToolCall, ToolEnv
from agentrl.env.api import Score
from agentrl.tools import HermesParser, ToolSet, tool

ITEMS, SHELVES = ["bolts", "nuts", "gears"], ["A", "B", "C"]


class WarehouseEnv(ToolEnv):
    """Count one item across every shelf of a seeded warehouse; reward 1 for the exact total."""

    def __init__(self, split: str = "train", n_tasks: int = 50):
        self.n_tasks = n_tasks
        self.stock: dict[tuple[str, str], int] = {}

        @tool
        def count(item: str, shelf: str) -> str:
            """How many of an item one shelf holds.

            Args:
                item: One of bolts, nuts, gears.
                shelf: One of A, B, C.
            """
            if (item, shelf) not in self.stock:
                raise ValueError(f"no such item or shelf: {item!r}, {shelf!r}")  # shown to the model
            return str(self.stock[item, shelf])

        super().__init__(ToolSet([count]), HermesParser(), split=split, max_turns=6)

    def load_tasks(self, split: str) -> list[Task]:
        rng = random.Random(f"warehouse-{split}")  # a fixed task list per split
        return [Task(f"{split}-{i}", {"item": rng.choice(ITEMS),
                                      "stock": {f"{item}/{shelf}": rng.randint(0, 9) for item in ITEMS
                                                for shelf in SHELVES}}, split)
                for i in range(self.n_tasks)]

    def on_reset(self, task: Task) -> None:
        super().on_reset(task)
        self.stock = {tuple(key.split("/")): n for key, n in task.data["stock"].items()}

    def first_messages(self, task: Task) -> list[Message]:
        return [Message("user", f"How many {task.data['item']} are there on shelves A, B and C together? "
                                "Count them with the tool, then answer with <answer>N</answer>.")]

    def score(self, task: Task, answer: str, transcript) -> Score:
        total = sum(self.stock[task.data["item"], shelf] for shelf in SHELVES)
        return Score({"outcome": float(answer.strip() == str(total))})

    def gold_actions(self, task: Task) -> list[str]:
        """A perfect episode, which `agentrl.check` plays to prove the maximum reward is reachable."""
        calls = [HermesParser().format_call(ToolCall("count", {"item": task.data["item"], "shelf": s}))
                 for s in SHELVES]
        total = sum(task.data["stock"][f"{task.data['item']}/{s}"] for s in SHELVES)
        return [*calls, f"<answer>{total}</answer>"]


# By id, as `module:Class` (here this script's own module) with default kwargs that `make` can override.
agentrl.register("tutorial/warehouse-v0", entry_point=f"{__name__}:WarehouseEnv", n_tasks=20)
# --8<-- [end:env]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=Path.home() / ".cache/agentrl/models/tiny")
    args = parser.parse_args()

    # --8<-- [start:main]
    # 1. Gymnasium's checker, seeding, and the gold solution of every task: an empty list means it passes.
    problems = agentrl.check("tutorial/warehouse-v0")
    assert problems == [], problems
    print("check: passed")

    # 2. One episode by hand: the observation after each action is what the model would read next.
    env = agentrl.make("tutorial/warehouse-v0")
    obs, info = env.reset(seed=0)
    print(f"user: {obs[0].content}")
    for action in env.gold_actions(env.task):
        obs, reward, terminated, truncated, info = env.step(action)
        print(f"model: {action}\n  env: {obs[0].content if obs else '(episode over)'} (reward {reward})")

    # 3. Episodes of the (untrained) tiny model through the rollout engine: token ids and loss masks.
    from agentrl.policy.hf import HFPolicy
    from agentrl.renderer import Renderer
    from agentrl.rollout.engine import RolloutConfig, RolloutEngine
    from agentrl.models.tiny import build_tiny_model
    from agentrl.models.tokenizer import load_tokenizer

    model_dir = build_tiny_model(args.model, quiet=True)
    with RolloutEngine(lambda: agentrl.make("tutorial/warehouse-v0"), HFPolicy.load(str(model_dir)),
                       Renderer(load_tokenizer(model_dir)), RolloutConfig(max_total_tokens=768)) as engine:
        groups = asyncio.run(engine.run(env.tasks[:4]))
    for trajectory in (t for g in groups for t in g.trajectories):
        sampled = sum(trajectory.loss_mask)
        print(f"{trajectory.task_id}: {trajectory.status.value}, reward {trajectory.reward}, "
              f"{len(trajectory.turns)} turns, {sampled} of {len(trajectory.token_ids)} tokens sampled")
    # --8<-- [end:main]


if __name__ == "__main__":
    main()
