"""Evaluation suites: named, versioned collections of (env id, split, number of tasks), registered like envs.

    agentrl eval --suite search/heldout --model DIR          # a registered suite
    agentrl eval --suite my_suite.toml --model DIR           # a suite file:

    name = "my/heldout"
    version = 1
    [[entries]]
    env = "search/r1-v0"
    split = "unseen_entities"
    n_tasks = 100
    env_kwargs = { topk = 1 }

Packages register suites with `agentrl.register_suite(Suite(...))` (e.g. from their env entry point).
A suite's results are comparable only at the same version: bump it when an entry changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import with_config

from agentrl.config import STRICT, load_config
from agentrl.env.registry import did_you_mean, registry


@with_config(STRICT)
@dataclass(frozen=True)
class SuiteEntry:
    env: str  # env id
    split: str  # task split of that env
    n_tasks: int = 100  # the first n tasks of the split
    env_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """`"<env>:<split>"`: the entry's name in results, unique within a suite."""
        return f"{self.env}:{self.split}"

    def __post_init__(self) -> None:
        if self.n_tasks < 1:
            raise ValueError(f"n_tasks must be >= 1, got {self.n_tasks}")


@with_config(STRICT)
@dataclass(frozen=True)
class Suite:
    name: str
    entries: tuple[SuiteEntry, ...]
    version: int = 0
    description: str = ""

    def __post_init__(self) -> None:
        names = [e.name for e in self.entries]
        if not names:
            raise ValueError(f"suite {self.name!r} has no entries")
        if len(set(names)) != len(names):
            raise ValueError(f"suite {self.name!r} lists an (env, split) twice: {names}")


_suites: dict[str, Suite] = {}


def register_suite(suite: Suite) -> None:
    """Register `suite` under its name; registering an equal suite again is a no-op, a different one raises."""
    if suite.name in _suites and _suites[suite.name] != suite:
        raise ValueError(f"suite {suite.name!r} is already registered with other entries")
    _suites[suite.name] = suite


def suites() -> dict[str, Suite]:
    """All registered suites, by name: ours register with our envs, which `registry()` loads first."""
    registry()

    return dict(sorted(_suites.items()))


def get_suite(name_or_path: str) -> Suite:
    """A registered suite by name, or a suite TOML file by path."""
    if name_or_path.endswith(".toml"):
        return load_suite(name_or_path)
    known = suites()
    if name_or_path not in known:
        raise KeyError(f"No suite {name_or_path!r}.{did_you_mean(name_or_path, known)} Registered: "
                       f"{', '.join(known)}; or pass a .toml file.")
    return known[name_or_path]


def load_suite(path: str | Path) -> Suite:
    """A suite from TOML; `ConfigError` names what is wrong."""
    return load_config(Suite, path)
