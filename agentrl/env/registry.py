"""Environments by id: `register`, `make`, `registry`, and the `agentrl envs check` logic.

Ids are versioned (`math/arith-v0`). Our own envs register when `agentrl.envs` is imported; third-party
packages register through the `agentrl.envs` entry-point group, whose entry points name a function
that calls `agentrl.register(...)` (or a module that does so when imported). An env registered with
`venv=Venv(python=..., requirements=(...))` runs in a virtualenv of its own, behind a server (`agentrl.env.remote`).
"""

from __future__ import annotations

import difflib
import importlib
import threading
import warnings
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Iterable

from gymnasium.utils.env_checker import check_env

from agentrl.env.api import TextEnv
from agentrl.env.venvs import Venv

ENTRY_POINT_GROUP = "agentrl.envs"


@dataclass(frozen=True)
class EnvSpec:
    id: str
    entry_point: str  # "package.module:Class"
    kwargs: dict[str, Any] = field(default_factory=dict)
    venv: Venv | None = None  # its own virtualenv: made in another process, behind a server

    def load(self) -> type[TextEnv]:
        """Import the env class that `entry_point` names."""
        module, _, attr = self.entry_point.partition(":")
        return getattr(importlib.import_module(module), attr)


_specs: dict[str, EnvSpec] = {}
_plugins_loaded = False
# envs are made from several threads at once (the rollout engine's, a Ray worker's): the first loads the
# plugins while the others wait; reentrant, for a plugin that looks up the registry while it loads
_plugins_lock = threading.RLock()


def register(id: str, entry_point: str, venv: Venv | None = None, **kwargs: Any) -> None:
    """Register an env class under `id`; `kwargs` are its defaults, overridable in `make`. With `venv`, the class is
    imported and made only in that virtualenv (`entry_point` need not import here)."""
    if ":" not in entry_point:
        raise ValueError(f"entry_point must look like 'package.module:Class', got {entry_point!r}")
    if id in _specs and _specs[id].entry_point != entry_point:
        raise ValueError(f"Env id {id!r} is already registered to {_specs[id].entry_point}")
    _specs[id] = EnvSpec(id, entry_point, dict(kwargs), venv)


def registry() -> dict[str, EnvSpec]:
    """All registered envs: ours and those of installed plugins."""
    _load_plugins()
    return dict(sorted(_specs.items()))


def spec(id: str) -> EnvSpec:
    """The registration of `id`; an unknown id raises `KeyError` naming the closest registered ids."""
    specs = registry()
    if id not in specs:
        raise KeyError(f"No env {id!r}.{did_you_mean(id, specs)} Registered ids: {', '.join(specs)}. "
                       f"Third-party envs register through the {ENTRY_POINT_GROUP!r} entry-point group.")
    return specs[id]


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """The hint ` Did you mean 'x' or 'y'?` for the names closest to `name`; empty if none is close."""
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.4)
    return f" Did you mean {' or '.join(map(repr, close))}?" if close else ""


def make(id: str, **kwargs: Any) -> TextEnv:
    """Build a fresh env instance; `kwargs` override the registered defaults."""
    s = spec(id)
    if s.venv is not None:
        from agentrl.env.remote import make_remote  # the OpenEnv client: an optional dependency
        return make_remote(id, s.entry_point, s.venv, {**s.kwargs, **kwargs})
    return s.load()(**{**s.kwargs, **kwargs})


def check(id: str, n_tasks: int = 8, **kwargs: Any) -> list[str]:
    """Gymnasium's API checker plus the env's own `validate()`; returns the problems found (empty = pass)."""
    return check_instance(make(id, **kwargs), n_tasks)


def check_instance(env: TextEnv, n_tasks: int = 8) -> list[str]:
    """`check` on an env instance (closed afterwards)."""
    problems = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            check_env(env, skip_render_check=True)
        except (AssertionError, TypeError, ValueError, AttributeError) as e:  # what check_env raises
            problems.append(f"check_env: {type(e).__name__}: {e}")
    problems += [f"check_env warning: {w.message}" for w in caught if "gymnasium" in w.filename]
    problems += [f"validate: {f}" for f in env.validate(n_tasks)]
    env.close()
    return problems


def _load_plugins() -> None:
    global _plugins_loaded
    with _plugins_lock:
        if _plugins_loaded:
            return
        _plugins_loaded = True
        importlib.import_module("agentrl.envs")  # our own envs
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            obj = ep.load()
            if callable(obj):
                obj()
