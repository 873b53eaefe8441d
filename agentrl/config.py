"""Typed configs from TOML recipes: one dataclass per entry point, validated at load time.

Unknown keys, wrong types and impossible combinations (checked in the dataclasses' `__post_init__`) are
errors that name the key, not silent no-ops. Validation is pydantic's; the configs stay plain dataclasses.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from dataclasses import dataclass
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
    `overrides` (nested dicts) applied on top; then a class with a `derive(data) -> data` static method fills
    the tables that start from another table of the same recipe (e.g. `TrainJob`'s `[eval.rollout]`)."""
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
    data = with_table_defaults(cls, getattr(cls, "derive", lambda table: table)(data))
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


@dataclass(frozen=True)
class TableDefaults:
    """A field's table defaults (`table_defaults`), applied by `load_config` to the recipe's table."""

    values: dict[str, Any]


def table_defaults(**defaults: Any) -> TableDefaults:
    """For a field's `Annotated` type: the recipe's table starts from `defaults` (merged key by key), the values
    the field's default has, so that a table which leaves a key out gets what no table at all would give:
    `rollout: Annotated[RolloutConfig, table_defaults(group_size=8)] = field(default_factory=...)`. Applied to the
    recipe before validation (a validator would see Python lists, which strict mode refuses for tuples)."""
    return TableDefaults(defaults)


def with_table_defaults(cls: Any, data: Any) -> Any:
    """`data` (a recipe's table for `cls`) with every table of a `table_defaults` field started from its defaults,
    in nested tables and lists of tables too."""
    if isinstance(data, list):
        return [with_table_defaults(cls, item) for item in data]
    if not (dataclasses.is_dataclass(cls) and isinstance(data, dict)):
        return data
    hints, out = typing.get_type_hints(cls, include_extras=True), dict(data)
    for f in dataclasses.fields(cls):
        if f.name in out:
            hint = hints[f.name]
            marks = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, TableDefaults)]
            value = merge(marks[0].values, out[f.name]) if marks and isinstance(out[f.name], dict) else out[f.name]
            out[f.name] = with_table_defaults(_dataclass_of(hint), value)
    return out


def _dataclass_of(hint: Any) -> Any:
    """The config dataclass a field's type holds: `X`, `Annotated[X, ...]`, `X | None`, `list[X]`, `X | list[X]`."""
    if dataclasses.is_dataclass(hint):
        return hint
    found = [_dataclass_of(arg) for arg in typing.get_args(hint)]
    return next((c for c in found if c is not None), None)


def merge(base: dict[str, Any] | list, overrides: dict[str, Any]) -> dict[str, Any] | list:
    """`base` with `overrides` applied on top, nested dicts merged key by key (neither is modified). A list
    takes overrides by index (what `--set sft.1.episodes=16` gives): `{"1": {"episodes": 16}}`."""
    if isinstance(base, list):
        unknown = set(overrides) - {str(i) for i in range(len(base))}
        if unknown:
            raise ConfigError(f"{sorted(unknown)} would index a list of {len(base)}: use 0 to {len(base) - 1}")
        return [_merged(item, overrides[str(i)]) if str(i) in overrides else item for i, item in enumerate(base)]
    out = dict(base)
    for key, value in overrides.items():
        out[key] = _merged(out.get(key, {}), value)
    return out


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
