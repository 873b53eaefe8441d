"""Rollouts ahead of training: the rollout engine in a thread of its own, feeding the buffer group by group.

    buffer = GroupBuffer(keep, max_staleness=1)
    source = RolloutSource(EnvEngines(make_env), policy, renderer, rollout, task_at, buffer, tasks_per_step=8,
                           seed=0)
    source.start()
    taken = buffer.take(8, version=0)   # the trainer's thread: the first 8 kept groups to finish
    source.sync(model, 1)               # the new weights into the engine; episodes in flight go on with them
    source.close()

**Staleness.** A group may start only while fewer than `(syncs + max_staleness + 1) * tasks_per_step` groups are
in flight, waiting in the buffer or trained in this run, so that the engine runs at most `max_staleness` steps
ahead of the trainer; a group that still comes out older (a slow episode overtaken by later ones) is dropped at the
take (`GroupBuffer`). **Partial rollouts.** `VersionGate` makes a weight sync wait for the `generate` calls in
flight (as vLLM's pause does) and holds new ones until the new weights are in: an episode's next turn samples from
the new weights, and each turn records the version that sampled it (`Turn.weight_version`), so that the loss takes
each token's behaviour logprobs from the weights that really sampled it. With `restart = True` a sync aborts the
groups in flight instead, and plays them again from the start with the new weights (for envs whose episodes cannot
continue under other weights).

Task `p` of the stream is played with env seed `seeds.episode_seed(seed, p)`, and its trajectories' `group` is `p`: a
run resumed from a checkpoint replays the positions that were in flight, with the same seeds, and skips those done.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections import deque
from dataclasses import replace
from typing import Any, Callable, Collection, Coroutine, Sequence

from agentrl.policy.protocol import Policy, Sample, SamplingParams
from agentrl.renderer import Renderer
from agentrl.rollout import seeds
from agentrl.rollout.buffer import GroupBuffer
from agentrl.rollout.engine import Engines, RolloutConfig
from agentrl.rollout.timeline import Timeline
from agentrl.types import Task


class VersionGate:
    """`policy` with each weight sync between `generate` calls: a sync waits for those in flight and holds new ones
    until the new weights are in, so that every sample comes from one weight version, which it carries. `pause` and
    `resume` are a sync's two halves, for a sync that another process sends (a Ray rollout source's trainer)."""

    def __init__(self, policy: Policy):
        self.policy, self._active, self._version = policy, 0, None  # None: the policy's own version
        self._open, self._idle = asyncio.Event(), asyncio.Event()  # no sync running; no generate running
        self._open.set()
        self._idle.set()

    def __getattr__(self, name: str) -> Any:  # the rest of the backend (model, parity, ...) as is
        return getattr(self.policy, name)

    @property
    def weight_version(self) -> int:
        """The version the policy samples with now."""
        return self.policy.weight_version if self._version is None else self._version

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> list[Sample]:
        """The policy's samples, each with the weight version that sampled it."""
        while not self._open.is_set():
            await self._open.wait()
        self._active += 1
        self._idle.clear()
        try:
            version = self.weight_version
            samples = await self.policy.generate(prompt_ids, sampling)
        finally:
            self._active -= 1
            if not self._active:
                self._idle.set()
        return [replace(s, weight_version=version) for s in samples]

    async def pause(self) -> None:
        """Hold new `generate` calls and wait for those in flight."""
        self._open.clear()
        await self._idle.wait()

    def resume(self, version: int | None) -> None:
        """Let `generate` calls through again, sampling as `version` (None: the weights did not change)."""
        if version is not None:
            self._version = version
        self._open.set()

    async def sync_weights(self, model: Any, version: int) -> None:
        """Load `model`'s weights as `version` once no `generate` is in flight; new ones wait meanwhile."""
        synced = None
        try:
            await self.pause()
            await self.policy.sync_weights(model, version)
            synced = version
        finally:
            self.resume(synced)

    async def close(self) -> None:
        """Close the policy."""
        await self.policy.close()


class RolloutSource:
    """Plays groups of `group_size` episodes of the tasks `task_at(0), task_at(1), ...` (the positions in `skip`
    left out, from `start`; with `share = (i, n)`, as source i of n, only the positions p with p % n == i), at most
    `max_staleness` steps ahead of the trainer, and puts each group into `buffer` as it finishes (`restart`: a sync
    plays the groups in flight again instead of continuing them). `engines` makes the engine that plays them
    (`EnvEngines(make_env)`, or agent programs' `AgentEngines`). Runs its own event loop in a thread; `sync` and
    `close` are called from the trainer's (`pause` and `resume` are a sync's halves, when the trainer sends the weights
    itself: to a source in a Ray actor, `agentrl/rollout/ray_source.py`)."""

    def __init__(self, engines: Engines, policy: Policy, renderer: Renderer, config: RolloutConfig,
                 task_at: Callable[[int], Task], buffer: GroupBuffer, *, tasks_per_step: int, seed: int,
                 start: int = 0, skip: Collection[int] = (), timeline: Timeline | None = None, restart: bool = False,
                 share: tuple[int, int] = (0, 1)):
        self.policy, self.buffer, self.task_at = VersionGate(policy), buffer, task_at
        self.engine = engines(self.policy, renderer, config, timeline)
        self.tasks_per_step, self.seed, self.start_at, self.skip = tasks_per_step, seed, start, frozenset(skip)
        self.share, self.finished = share, 0  # groups put into the buffer
        self.in_flight, self.syncs, self.restart, self.restarted, self._syncing = 0, 0, restart, 0, False
        self._running: dict[int, asyncio.Task] = {}  # by task position
        self._replay: deque[int] = deque()  # aborted positions, played again first
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Task | None = None
        self._ready, self._thread = threading.Event(), threading.Thread(target=self._run, name="agentrl-rollouts",
                                                                        daemon=True)

    def start(self) -> None:
        """Start playing episodes in the background."""
        self._thread.start()
        self._ready.wait()

    def sync(self, model: Any, version: int) -> None:
        """`model`'s weights into the engine as `version` (blocks until they are in); lets the source run one step
        further ahead. Raises the source's failure if it has stopped."""
        self.run(self._sync(model, version))

    def recount(self) -> None:
        """The buffer's `discarded` changed outside the source's thread: look for room again."""
        self._loop.call_soon_threadsafe(self._room.set)

    def pause(self) -> None:
        """The first half of a sync sent from outside: no group starts and no `generate` call runs (with `restart`,
        the groups in flight are aborted) until `resume`."""
        self.run(self._pause())

    def resume(self, version: int | None) -> None:
        """The second half: sampling goes on as `version` (None: the sync failed, the weights are the old ones)."""
        self.run(self._resume(version))

    def run(self, coroutine: Coroutine) -> Any:
        """Runs `coroutine` on the source's event loop, beside its episodes, and returns its result (blocks until then).
        Raises the source's failure if it has stopped."""
        try:
            self.buffer.check()
        except BaseException:
            coroutine.close()  # never scheduled: closed here, not left for the garbage collector to warn about
            raise
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def close(self) -> None:
        """Stop: episodes in flight are cancelled (their envs closed), and the engine's threads shut down."""
        if self._loop is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # its loop closed on its own (the source failed) as it ends
                self._loop.call_soon_threadsafe(self._main.cancel)
            self._thread.join()

    def _run(self) -> None:
        try:
            with self.engine:  # the engine lives as long as the loop its episodes run on, however that ends
                asyncio.run(self._produce())
        except asyncio.CancelledError:  # closed
            pass
        except BaseException as e:  # noqa: BLE001 -- the trainer's next take raises it
            self.buffer.fail(e)
        finally:
            self._ready.set()

    async def _sync(self, model: Any, version: int) -> None:
        synced = None
        try:
            await self._pause()
            await self.policy.policy.sync_weights(model, version)
            synced = version
        finally:
            await self._resume(synced)

    async def _pause(self) -> None:
        self._syncing = True  # no group starts until the new weights are in
        if self.restart:  # abort what is in flight (envs closed), to play it again with the new weights
            aborted = list(self._running.items())
            for _, task in aborted:
                task.cancel()
            await asyncio.gather(*(task for _, task in aborted), return_exceptions=True)
            self._replay.extend(sorted(position for position, _ in aborted))
            self.restarted += len(aborted)
        await self.policy.pause()

    async def _resume(self, version: int | None) -> None:
        self.policy.resume(version)
        self.syncs += version is not None
        self._syncing = False
        self._room.set()

    def _has_room(self) -> bool:
        live = self.in_flight + self.finished - self.buffer.discarded[self.share[0]]  # started, less refused or stale
        return not self._syncing and live < (self.syncs + self.buffer.max_staleness + 1) * self.tasks_per_step

    async def _produce(self) -> None:
        self._loop, self._main = asyncio.get_running_loop(), asyncio.current_task()
        offset, sources = self.share
        fresh = (p for p in itertools.count(self.start_at) if p % sources == offset and p not in self.skip)
        self._room = asyncio.Event()
        gate = asyncio.Semaphore(self.engine.config.concurrency)
        self._ready.set()
        try:
            while True:
                while not self._has_room():
                    self._room.clear()
                    await self._room.wait()
                position = self._replay.popleft() if self._replay else next(fresh)
                self.in_flight += 1
                self._running[position] = asyncio.create_task(self._play(position, gate))
        finally:
            for task in self._running.values():
                task.cancel()
            await asyncio.gather(*self._running.values(), return_exceptions=True)  # their envs close

    async def _play(self, position: int, gate: asyncio.Semaphore) -> None:
        try:
            env_seed = seeds.episode_seed(self.seed, position)
            group = await self.engine.run_group(self.task_at(position), env_seed, position, gate)
            self.finished += 1
            self.buffer.put(group)
        except Exception as e:  # noqa: BLE001 -- episodes capture their own failures: this is the source's
            self.buffer.fail(e)
            self._main.cancel()
        finally:
            self.in_flight -= 1
            self._running.pop(position, None)
            self._room.set()
