"""`web/shop-v0`: buy what the instruction asks for in a local shop (WebShop-like), in a real Chromium.

The shop (`app.py`) runs on the loopback in this process over a generated catalog (`catalog.py`); each
episode gets its own session in it. The episode ends when the model places an order (or calls done). Reward
components: `shop_reward` (WebShop's reward of the order; the reward by default) and `success` (it is 1).
Splits: `train` and `heldout` draw goals from disjoint halves of the catalog.
"""

from __future__ import annotations

import threading
import uuid
from typing import Iterator, Sequence

from agentrl.env.api import Score
from agentrl.envs.web.env import START_TIMEOUT, WebEnv, find_one
from agentrl.envs.web.shop.app import ShopServer
from agentrl.envs.web.shop.catalog import Goal, generate_catalog, generate_goals, reward
from agentrl.tools import ParsedAction
from agentrl.types import Task, ToolCall

SPLIT_SEEDS = {"train": 1, "heldout": 2}
_SERVERS: dict[tuple[int, int], ShopServer] = {}
_SERVERS_LOCK = threading.Lock()


def shop_server(catalog_seed: int, n_products: int) -> ShopServer:
    """This process's shop over this catalog, started on first use."""
    with _SERVERS_LOCK:
        key = (catalog_seed, n_products)
        if key not in _SERVERS:
            _SERVERS[key] = ShopServer(generate_catalog(catalog_seed, n_products))
        return _SERVERS[key]


class ShopEnv(WebEnv):
    """Buy what the instruction asks for in a local shop (`web/shop-v0`), scored by WebShop's reward."""

    def __init__(self, split: str = "train", n_tasks: int = 500, catalog_seed: int = 0, n_products: int = 400,
                 max_turns: int = 12, **kwargs):
        if split not in SPLIT_SEEDS:
            raise ValueError(f"unknown shop split {split!r}; splits: {', '.join(SPLIT_SEEDS)}")
        self.n_tasks, self.catalog_seed, self.n_products = n_tasks, catalog_seed, n_products
        self.products = generate_catalog(catalog_seed, n_products)
        self.by_id = {p.id: p for p in self.products}
        self._shop_session = ""
        kwargs.setdefault("reward_weights", {"shop_reward": 1.0})
        super().__init__(split=split, max_turns=max_turns, **kwargs)

    @property
    def server(self) -> ShopServer:
        """This process's shop server over the env's catalog, started on first use."""
        return shop_server(self.catalog_seed, self.n_products)

    def load_tasks(self, split: str) -> Sequence[Task]:
        """`n_tasks` goals of `split`, drawn from its half of the catalog (even products for train, odd for heldout)."""
        half = [p for i, p in enumerate(self.products) if i % 2 == (split == "heldout")]
        goals = generate_goals(half, SPLIT_SEEDS[split] * 1000 + self.catalog_seed, self.n_tasks)
        return [Task(f"shop/{split}/{i}", {"goal": g.to_dict(), "instruction": g.instruction,
                                           "title": self.by_id[g.product_id].title})
                for i, g in enumerate(goals)]

    def start(self, task: Task) -> None:
        self.server.orders.pop(self._shop_session, None)  # an order of an episode cut short
        self._shop_session = uuid.uuid4().hex[:12]
        self.session.goto(self.server.url(self._shop_session), timeout=START_TIMEOUT)

    def instruction(self, task: Task) -> str:
        return task.data["instruction"]

    def finished(self) -> bool:
        return self._shop_session in self.server.orders

    def score(self, task: Task, answer: str, transcript: Sequence[ParsedAction]) -> Score:
        order = self.server.orders.pop(self._shop_session, None)
        if order is None:
            return Score({"shop_reward": 0.0, "success": 0.0}, "no order was placed")
        product, chosen = order
        total, parts = reward(Goal.from_dict(task.data["goal"]), product, chosen)
        detail = f"bought {product.title} ({chosen}) for ${product.price:.2f}; " + \
            ", ".join(f"{k}={v:g}" for k, v in parts.items())
        return Score({"shop_reward": total, "success": float(total == 1.0)}, detail)

    def solve(self, task: Task) -> Iterator[ToolCall]:
        """Search for the goal's words, page through the results to the goal's product, pick the options, buy."""
        goal = Goal.from_dict(task.data["goal"])
        page = self.session.observe()
        yield ToolCall("fill", {"id": page.find("textbox")[0]["id"], "text": goal.search_query()})
        yield ToolCall("click", {"id": find_one(self.session.observe(), "button", "Search")})
        while not (page := self.session.observe()).find("link", task.data["title"]):
            yield ToolCall("click", {"id": find_one(page, "link", "Next >")})
        yield ToolCall("click", {"id": find_one(page, "link", task.data["title"])})
        for value in goal.options.values():
            yield ToolCall("click", {"id": find_one(self.session.observe(), "radio", value)})
        yield ToolCall("click", {"id": find_one(self.session.observe(), "button", "Buy Now")})
