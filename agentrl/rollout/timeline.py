"""When the engine, the envs and the trainer were busy: the intervals that `agentrl report` draws as a timeline.

    timeline = Timeline()
    with timeline.engine:      # from any thread; nested or overlapping uses count as one busy stretch
        ...
    step = timeline.cut()      # {"engine": [[t0, t1], ...], "env": [...], "trainer": [...]}, seconds since start

A resource is busy while at least one use of it is open: 32 episodes waiting on `generate` at once are one busy
engine, not 32. Users tune asynchronous training by the idle fractions (`idle_fractions`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

RESOURCES = ("engine", "env", "trainer")


class Busy:
    """A thread-safe count of open uses; records an interval each time it goes from idle to busy and back."""

    def __init__(self, origin: float):
        self._origin, self._lock, self._open, self._since = origin, threading.Lock(), 0, 0.0
        self._done: list[list[float]] = []

    def __enter__(self) -> Busy:
        with self._lock:
            if self._open == 0:
                self._since = time.perf_counter()
            self._open += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self._open -= 1
            if self._open == 0:
                self._done.append([self._since - self._origin, time.perf_counter() - self._origin])

    def add(self, intervals: list[list[float]]) -> None:
        """Busy intervals recorded elsewhere (another process's, on this clock), merged with this one's."""
        with self._lock:
            merged: list[list[float]] = []
            for a, b in sorted(self._done + [list(span) for span in intervals]):
                if merged and a <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], b)
                else:
                    merged.append([a, b])
            self._done = merged

    def cut(self) -> list[list[float]]:
        """The intervals finished since the last cut, and the open one up to now (it continues from now)."""
        with self._lock:
            now, out, self._done = time.perf_counter(), self._done, []
            if self._open:
                out.append([self._since - self._origin, now - self._origin])
                self._since = now
        return [[round(a, 4), round(b, 4)] for a, b in out]


class Timeline:
    """One `Busy` per resource (`engine`, `env`, `trainer`), on one clock that starts when the timeline does, or at
    `started` (`time.time()`, another process's timeline's `started`: both then read the same clock)."""

    def __init__(self, started: float | None = None) -> None:
        self.origin = time.perf_counter() - (0.0 if started is None else time.time() - started)
        self.started = time.time() - (time.perf_counter() - self.origin)  # the wall-clock time of the origin
        self.engine, self.env, self.trainer = (Busy(self.origin) for _ in RESOURCES)

    def now(self) -> float:
        """Seconds since the timeline started."""
        return round(time.perf_counter() - self.origin, 4)

    def cut(self) -> dict[str, list[list[float]]]:
        """Every resource's busy intervals since the last cut."""
        return {name: getattr(self, name).cut() for name in RESOURCES}


def idle_fractions(intervals: dict[str, list[list[float]]], start: float, end: float) -> dict[str, float]:
    """Per resource, the fraction of [start, end] in none of its (disjoint, as `Busy` records them) intervals."""
    span = max(end - start, 1e-9)
    return {name: round(1 - sum(min(b, end) - max(a, start) for a, b in spans if b > start and a < end) / span, 4)
            for name, spans in intervals.items()}
