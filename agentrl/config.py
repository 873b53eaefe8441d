"""Typed configs from TOML recipes: one dataclass per entry point, validated at load time (by pydantic; the configs
stay plain dataclasses). Unknown keys, wrong types and impossible combinations (each dataclass's `__post_init__`) are
errors that name the key, not silent no-ops."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Sequence, TypeVar

from pydantic import ConfigDict, TypeAdapter, ValidationError

T = TypeVar("T")

# Put on every config dataclass: `@with_config(STRICT)`. Extra keys are errors; numbers are not parsed from strings
# (`load_config` validates the recipe as JSON: strict mode there takes arrays for tuples and tables for dataclasses).
STRICT = ConfigDict(extra="forbid", strict=True, arbitrary_types_allowed=False)


class ConfigError(ValueError):
    """A recipe does not describe a valid config; the message names the offending keys."""


def load_config(cls: type[T], source: str | Path | dict[str, Any] | None = None,
                overrides: dict[str, Any] | None = None, unset: Sequence[str] = ()) -> T:
    """Build `cls` from a TOML file (or a dict), the dotted keys in `unset` removed (their defaults apply), with
    `overrides` (nested dicts) applied on top, then `cls.derive(data)` if it has one: the tables that start from
    another table of the same recipe (e.g. `TrainJob`'s `[eval.rollout]`)."""
    if source is None or isinstance(source, dict):
        data, where = dict(source or {}), "config"
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"No recipe at {path}.")
        try:
            data, where = tomllib.loads(path.read_text()), str(path)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
    data = merge(without(data, unset, where), overrides or {})
    data = getattr(cls, "derive", lambda table: table)(data)
    try:
        return TypeAdapter(cls).validate_json(json.dumps(data, default=_plain))
    except ValidationError as e:
        problems = "\n".join(f"  {'.'.join(map(str, err['loc'])) or '(top)'}: {err['msg']}{_given(err)}"
                             for err in e.errors())
        raise ConfigError(f"{where} is not a valid {cls.__name__}:\n{problems}") from None


def without(data: dict[str, Any], keys: Sequence[str], where: str = "config") -> dict[str, Any]:
    """`data` less each dotted key of `keys` (a whole table, or one value in it); a key it lacks is an error."""
    out = json.loads(json.dumps(data, default=_plain))  # a deep copy: `data` stays as it is
    for key in keys:
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            raise ConfigError(f"--unset {key}: {where} has no such key")
        del node[leaf]
    return out


def merge(base: dict[str, Any] | list, overrides: dict[str, Any]) -> dict[str, Any] | list:
    """`base` with `overrides` applied on top, nested dicts merged key by key (neither is modified). A list
    takes overrides by index (what `--set sft.1.episodes=16` gives): `{"1": {"episodes": 16}}`."""
    if isinstance(base, list):
        unknown = set(overrides) - {str(i) for i in range(len(base))}
        if unknown:
            raise ConfigError(f"{sorted(unknown)} would index a list of {len(base)}: use 0 to {len(base) - 1}")
        return [_merged(item, overrides[str(i)]) if str(i) in overrides else item for i, item in enumerate(base)]
    return {**base, **{key: _merged(base.get(key, {}), value) for key, value in overrides.items()}}


def _merged(base: Any, value: Any) -> Any:
    return merge(base, value) if isinstance(value, dict) and isinstance(base, (dict, list)) else value


def _given(error: dict[str, Any]) -> str:
    """`, got '20'` for a value of the wrong type (not for a missing key or a whole table)."""
    value = error.get("input")
    return "" if error["type"] == "missing" or isinstance(value, (dict, list)) else f", got {value!r}"


def _plain(value: Any) -> Any:
    """What a recipe would hold in place of a Python value given in a dict: a path as its string."""
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"a config value must be what TOML can hold, got {type(value).__name__}: {value!r}")
