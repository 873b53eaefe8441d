"""SkyRL-Gym environments as agentrl envs: `skyrl/gsm8k-v0`, `skyrl/gsm8k_multi_turn-v0`, or any registered
SkyRL env class with `env_class=...`.

A task is a row of SkyRL's dataset format: `{"prompt": [{"role", "content"}, ...], "env_class": ...,
"reward_spec": {"method": "rule", "ground_truth": ...}, "extras": {...}}`, read from `data=PATH` (JSONL or
parquet, as SkyRL's own datasets are). The registered ids play the agentrl arithmetic env's questions without
data (`agentrl.envs.math.adapted`). Each episode makes a fresh SkyRL env (`skyrl_gym.make(env_class,
extras=row)`), `init(prompt)` gives the first messages, `step(text)` the observations, reward and done. The
gold solution is the row's `gold` field, or `#### <ground truth>` (the GSM8K answer format).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from agentrl.env.api import TextEnv
from agentrl.types import Message, Task

class SkyRLEnv(TextEnv):
    """A SkyRL-Gym env class played over rows of SkyRL's dataset format, a fresh SkyRL env per episode."""

    def __init__(self, env_class: str = "gsm8k", data: str | None = None, split: str = "train",
                 n_tasks: int | None = None, max_turns: int = 4, env_config: dict[str, Any] | None = None):
        try:
            import skyrl_gym
        except ImportError as e:
            raise ImportError("the SkyRL adapter needs `pip install skyrl-gym`") from e
        super().__init__(split=split, max_turns=max_turns)
        self.env_class, self.data, self.n_tasks = env_class, data, n_tasks
        self.env_config, self._skyrl, self.inner = dict(env_config or {}), skyrl_gym, None
        self._first: list[dict] = []

    def load_tasks(self, split: str) -> Sequence[Task]:
        """The rows of `data` (or the arithmetic env's questions), the first `n_tasks` of them, as tasks."""
        rows = read_rows(self.data) if self.data else self.default_rows(split)
        rows = rows[:self.n_tasks] if self.n_tasks else rows
        return [Task(f"skyrl/{row.get('env_class', self.env_class)}/{split}/{i}", row) for i, row in enumerate(rows)]

    def default_rows(self, split: str) -> list[dict]:
        """The rows used without `data`: none here (`agentrl.envs.math.adapted` gives arithmetic ones)."""
        raise ValueError("SkyRLEnv needs data=PATH: SkyRL dataset rows (JSONL or parquet)")

    def on_reset(self, task: Task) -> None:
        self.close()
        row = task.data
        extras = {**row.get("extras", {}), "reward_spec": row.get("reward_spec", {})}
        self.inner = self._skyrl.make(row.get("env_class", self.env_class), env_config=self.env_config,
                                      extras=extras)
        self._first, _ = self.inner.init(list(row["prompt"]))

    def first_messages(self, task: Task) -> Sequence[Message]:
        """The messages of the SkyRL env's `init(prompt)`."""
        return tuple(Message(m["role"], m["content"]) for m in self._first)

    def act(self, action: str):
        out = self.inner.step(action)
        observations = [Message(m.get("role", "user"), m["content"]) for m in out["observations"]]
        info = {"reward_components": {"skyrl": float(out["reward"])}} if out["done"] else {}
        return observations, float(out["reward"]), bool(out["done"]), info

    def gold_actions(self, task: Task) -> list[str]:
        if "gold" in task.data:
            return [task.data["gold"]]
        truth = task.data.get("reward_spec", {}).get("ground_truth")
        if truth is None:
            raise NotImplementedError("this row has neither `gold` nor reward_spec.ground_truth")
        return [f"#### {truth}"]

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
            self.inner = None


def read_rows(path: str) -> list[dict]:
    """SkyRL dataset rows from JSONL or parquet."""
    p = Path(path).expanduser()
    if p.suffix == ".parquet":
        import pandas as pd

        return [{k: _plain(v) for k, v in row.items()} for row in pd.read_parquet(p).to_dict("records")]
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def _plain(value: Any) -> Any:
    """Parquet gives numpy arrays for lists: back to Python lists and dicts."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
