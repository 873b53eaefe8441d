"""Trajectories on disk: one JSON line each, written as soon as the episode is done."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from agentrl.types import Trajectory


class JsonlWriter:
    """Writes each trajectory as one JSON line as soon as it is done, so a crash loses nothing finished."""

    def __init__(self, path: str | Path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "w")

    def write(self, trajectory: Trajectory) -> None:
        """Append `trajectory` as one line and flush."""
        self._file.write(json.dumps(trajectory.to_dict(), ensure_ascii=False) + "\n")
        self._file.flush()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


def write_jsonl(trajectories: Iterable[Trajectory], path: str | Path) -> None:
    """Write `trajectories` to `path`, one JSON line each (the file is replaced)."""
    with JsonlWriter(path) as writer:
        for t in trajectories:
            writer.write(t)


def read_jsonl(path: str | Path) -> list[Trajectory]:
    """The trajectories of a JSONL file written by `JsonlWriter` (blank lines skipped)."""
    with open(path) as f:
        return [Trajectory.from_dict(json.loads(line)) for line in f if line.strip()]
