"""JSONL on disk: trajectories, and any append-only log of JSON objects (a training run's metrics.jsonl).

Writers append whole lines, flushed, so a crash loses nothing finished and cuts at most the line being
written. `read_records` reads every such file the same way: a cut last line is the crash's, dropped with a
warning (and, before appending again, cut off the file); a bad line anywhere else is damage, and an error.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

from agentrl.types import Trajectory

T = TypeVar("T")


class JsonlWriter:
    """Writes each record (a `Trajectory` or a JSON object) as one line as soon as it is done."""

    def __init__(self, path: str | Path, append: bool = False):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "ab" if append else "wb", buffering=0)

    def write(self, record: Trajectory | dict[str, Any]) -> None:
        """Append `record` as one line, in one unbuffered write: a kill cuts this line at most, never an earlier one."""
        data = record.to_dict() if isinstance(record, Trajectory) else record
        line = memoryview((json.dumps(data, ensure_ascii=False) + "\n").encode())
        while line:  # a write to a regular file is whole unless the disk fills or a signal lands
            line = line[self._file.write(line):]

    def close(self) -> None:
        """Close the file."""
        self._file.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_jsonl(records: Iterable[Trajectory | dict[str, Any]], path: str | Path) -> None:
    """`records` as the whole of `path`, one JSON line each: written beside it, then renamed (a crash leaves the
    old file)."""
    tmp = Path(f"{path}.tmp")
    with JsonlWriter(tmp) as writer:
        for record in records:
            writer.write(record)
    os.replace(tmp, path)


def read_jsonl(path: str | Path) -> list[Trajectory]:
    """The trajectories of a JSONL file written by `JsonlWriter` (`read_records`)."""
    return read_records(path, Trajectory.from_dict)


def read_records(path: str | Path, parse: Callable[[dict[str, Any]], T] = dict, repair: bool = False) -> list[T]:
    """`parse` of each JSON object of `path`, one a line (blank lines skipped).

    A last line that is not JSON (or not UTF-8: cut inside a character) is taken for a line cut by a crash: it
    is dropped with a warning, and with `repair` cut off the file too (a last line without its newline gets
    one), so that appending continues on a clean line. Repair only what this process is about to append to:
    another process may still be writing that line. Any other bad line is an error naming file and line."""
    path = Path(path)
    lines = path.read_bytes().splitlines(keepends=True)
    records, whole = [], 0  # whole: the bytes of the lines read so far
    for number, line in enumerate(lines, 1):
        try:
            data = json.loads(line) if line.strip() else None
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            if number < len(lines):
                raise ValueError(f"{path}:{number}: not a JSON line ({e}); the file is damaged") from None
            warnings.warn(f"{path}:{number}: dropped a last line cut short by a crash ({len(line)} bytes)"
                          + ("; cut off the file" if repair else ""), RuntimeWarning, stacklevel=2)
            break
        if data is not None:
            records.append(_parsed(parse, data, path, number))
        whole += len(line)
    if repair:
        _end_after(path, whole)
    return records


def _parsed(parse: Callable[[dict[str, Any]], T], data: Any, path: Path, number: int) -> T:
    try:
        if not isinstance(data, dict):
            raise TypeError(f"a {type(data).__name__}, not an object")
        return parse(data)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}:{number}: not a record of this file ({type(e).__name__}: {e})") from None


def _end_after(path: Path, size: int) -> None:
    """Cut `path` to its first `size` bytes (whole lines), ending it with a newline."""
    with open(path, "r+b") as f:
        f.truncate(size)
        if size:
            f.seek(size - 1)
            if f.read(1) != b"\n":
                f.write(b"\n")
