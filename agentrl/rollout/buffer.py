"""The bounded buffer between the rollout sources and the trainer (`../DESIGN.md`, "One training run").

Sources `put` each group as it finishes; the trainer `take`s a batch once enough kept groups are in. A group is
as old as its oldest token (`group_version`); at a take, groups older than `max_staleness` weight versions are
dropped and counted, never trained. Groups that the method's `keep` rule refuses (no baseline; with dynamic
sampling, rewards that do not vary) never enter the batch either. Thread-safe: sources run in another thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

from agentrl.types import Group


class RolloutSourceError(RuntimeError):
    """The rollout source stopped with an exception (it is the cause): training cannot get more groups."""


def group_version(group: Group) -> int:
    """The weight version of the group's oldest sampled token."""
    return min(t.weight_version for t in group.trajectories)


def group_position(group: Group) -> int:
    """The group's task position in the task stream (its trajectories' `group` index, as `RolloutSource` sets it)."""
    return group.trajectories[0].group


@dataclass(frozen=True)
class Taken:
    """What one `take` gives the trainer; every finished group is in exactly one take's `collected`."""

    kept: list[Group]  # the batch, oldest first
    collected: list[Group]  # the batch, and the groups refused or dropped since the last take (for the metrics)
    stale: list[Group]  # dropped as older than max_staleness

    @property
    def done(self) -> list[int]:
        """The task positions that left the buffer for good (trained, refused or stale): not to be replayed."""
        return [group_position(g) for g in self.collected]


class SourceFailure:
    """The first failure of a rollout source, kept under a condition that the source's consumers wait on."""

    def __init__(self) -> None:
        self._cond, self._failure = threading.Condition(), None

    def fail(self, error: BaseException) -> None:
        """The source died: the waiting and every later wait raise `RolloutSourceError` from `error` (the first
        failure, when several episodes' groups fail at once)."""
        with self._cond:
            self._failure = self._failure or error
            self._cond.notify_all()

    def check(self) -> None:
        """Raise `RolloutSourceError` if the source has failed."""
        with self._cond:
            if self._failure is not None:
                raise RolloutSourceError(f"the rollout source stopped: {self._failure!r}") from self._failure


class GroupBuffer(SourceFailure):
    """Finished groups waiting for the trainer. Its bound is the source's: no more than `max_staleness + 1` steps'
    worth of groups are started ahead of the trainer (`RolloutSource`)."""

    def __init__(self, keep: Callable[[Group], bool], max_staleness: int, shares: int = 1):
        super().__init__()
        self.keep, self.max_staleness = keep, max_staleness
        self._ready: list[Group] = []  # kept, not taken yet
        self._refused: list[Group] = []  # by `keep`, since the last take
        self.taken = 0  # groups given to the trainer so far
        # groups refused or dropped as stale so far, by the source that played them (the one of `shares` sources
        # whose task positions are those equal to its index modulo `shares`): it plays others in their place
        self.discarded = [0] * shares

    def put(self, group: Group) -> None:
        """Add a finished group."""
        with self._cond:
            kept = self.keep(group)
            (self._ready if kept else self._refused).append(group)
            if not kept:
                self._discard(group)
            self._cond.notify_all()

    def _discard(self, group: Group) -> None:
        self.discarded[group_position(group) % len(self.discarded)] += 1

    def ready(self) -> int:
        """Kept groups waiting to be taken."""
        with self._cond:
            return len(self._ready)

    def take(self, n: int, version: int, give_up_after: int | None = None) -> Taken:
        """The `n` oldest kept groups within `max_staleness` of `version` (the trainer's weights), waiting for them;
        with `give_up_after`, fewer (maybe none) once the groups ready and refused since the last take number that
        many (as a synchronous step with dynamic sampling stops refilling; stale groups do not count: the source
        plays others in their place)."""
        stale: list[Group] = []
        with self._cond:
            while True:
                self.check()  # the condition's lock is reentrant
                stale += [g for g in self._ready if version - group_version(g) > self.max_staleness]
                self._ready = [g for g in self._ready if version - group_version(g) <= self.max_staleness]
                seen = len(self._ready) + len(self._refused)
                if len(self._ready) >= n or (give_up_after is not None and seen >= give_up_after):
                    break
                self._cond.wait()
            self._ready.sort(key=group_version)  # stable: the oldest first, then in finishing order
            kept, self._ready, refused, self._refused = self._ready[:n], self._ready[n:], self._refused, []
            self.taken += len(kept)
            for group in stale:
                self._discard(group)
        return Taken(kept, kept + refused + stale, stale)
