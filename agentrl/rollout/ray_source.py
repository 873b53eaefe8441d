"""Rollout sources as Ray actors: asynchronous training's episodes played in other processes, on any node.

    buffer = GroupBuffer(keep, max_staleness=1, shares=2)
    sources = RaySources(2, EnvEngines(make_env), policy, renderer, rollout, task_at, buffer, tasks_per_step=8,
                         seed=0)
    sources.start()                      # two actors, each playing its share of the task positions
    taken = buffer.take(8, version=0)    # the trainer's buffer, in its own process, filled as groups finish
    sources.sync(model, 1)               # every source paused, the weights sent from here, the sources resumed
    sources.close()

Each actor (`SourceActor`) runs a `RolloutSource` over a sampling copy of the policy (the same vLLM servers over
HTTP: the weights live in the engines, never in the actor) and the engine's envs (made in the actor, or in the
job's env workers); source i of n plays the task positions p with p % n == i, n-th of each step's tasks. Its
finished groups wait in the actor's `Outbox` until a thread of the trainer's process drains them into the trainer's
`GroupBuffer`, where the method's `keep` rule (which may ask a judge that lives with the trainer) and the staleness
bound apply as they do for a source in the trainer's process. The groups the buffer refused or dropped are counted
back to their source, which plays others in their place, so each source stays within `max_staleness` steps of the
trainer. A sync pauses every source (no `generate` call in flight), sends the weights from the trainer's process,
and resumes the sources with the new version. The sources' busy intervals until the pause join the trainer's
timeline at each sync.

A source that fails, or whose actor dies, fails the trainer's next take with the cause; the run then resumes from
its checkpoint like after any crash. A vLLM server that the trainer's process restarts is not seen by the sources'
copies until they next reach it: their requests in between fail as the episodes' errors.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, Collection, Coroutine

from agentrl.policy.protocol import Policy
from agentrl.renderer import Renderer
from agentrl.rollout.buffer import GroupBuffer, RolloutSourceError, SourceFailure
from agentrl.rollout.engine import Engines, RolloutConfig
from agentrl.rollout.source import RolloutSource
from agentrl.rollout.timeline import Timeline
from agentrl.types import Group, Task


class Outbox(SourceFailure):
    """A source actor's side of the trainer's buffer: finished groups wait here until drained; `discarded` (by the
    source's share) is what the trainer's buffer counted back."""

    def __init__(self, max_staleness: int, shares: int):
        super().__init__()
        self.max_staleness, self.discarded, self._groups = max_staleness, [0] * shares, []

    def put(self, group: Group) -> None:
        """A finished group, to go to the trainer."""
        with self._cond:
            self._groups.append(group)
            self._cond.notify_all()

    def drain(self, timeout: float) -> list[Group]:
        """The groups finished since the last drain, waiting up to `timeout` seconds for one (maybe none)."""
        with self._cond:
            self._cond.wait_for(lambda: self._groups or self._failure is not None, timeout)
            self.check()
            groups, self._groups = self._groups, []
        return groups


class SourceActor:
    """One rollout source in a Ray actor (made with `ray.remote` by `RaySources`); `policy` is a sampling copy."""

    def __init__(self, engines: Engines, policy: Policy, renderer: Renderer, config: RolloutConfig,
                 task_at: Callable[[int], Task], max_staleness: int, *, tasks_per_step: int, seed: int, start: int,
                 skip: Collection[int], restart: bool, share: tuple[int, int], started: float):
        self.outbox, self.timeline = Outbox(max_staleness, share[1]), Timeline(started)
        self.source = RolloutSource(engines, policy, renderer, config, task_at, self.outbox,
                                    tasks_per_step=tasks_per_step, seed=seed, start=start, skip=skip,
                                    timeline=self.timeline, restart=restart, share=share)
        self.source.start()

    def drain(self, discarded: int) -> list[Group]:
        """The groups finished since the last drain (waiting up to a second for one); `discarded`: how many of this
        source's groups the trainer's buffer has refused or dropped so far, each room for another."""
        self._count_back(discarded)
        return self.outbox.drain(1.0)

    def pause(self) -> None:
        """A sync's first half: no group starts and no `generate` call runs until `resume`."""
        self.source.pause()

    def resume(self, version: int | None, discarded: int) -> None:
        """Sample as `version` (None: the weights did not change), counting `discarded` as `drain` does."""
        self.outbox.discarded[self.source.share[0]] = discarded
        self.source.resume(version)

    def stats(self) -> dict[str, int]:
        """Groups in flight, and restarted so far."""
        return {"in_flight": self.source.in_flight, "restarted": self.source.restarted}

    def cut(self) -> dict[str, list[list[float]]]:
        """The source's engine and env busy intervals since the last cut, on the trainer's timeline clock."""
        return self.timeline.cut()

    def close(self) -> None:
        """Stop the source: episodes in flight are cancelled, their envs closed."""
        self.source.close()

    def _count_back(self, discarded: int) -> None:
        share = self.source.share[0]
        if discarded != self.outbox.discarded[share]:
            self.outbox.discarded[share] = discarded
            self.source.recount()


def source_problems(sources: int, max_staleness: int, tasks_per_step: int, over_http: bool,
                    section: str = "grpo") -> list[str]:
    """Why `sources` rollout sources in Ray actors cannot run with these settings (none: they can); `over_http`:
    the policy's engine is reached over HTTP (vLLM)."""
    problems = []
    if not max_staleness:
        problems.append(f"ray.sources plays asynchronous training's episodes: set {section}.max_staleness (e.g. 1)")
    if not over_http:
        problems.append("ray.sources plays episodes in other processes, which reach the engine over HTTP: set "
                        "engine.kind = 'vllm' (the in-process sampler's weights live in the trainer's process)")
    if tasks_per_step % sources:
        problems.append(f"ray.sources = {sources} must divide {section}.tasks_per_step ({tasks_per_step}): each "
                        "source plays an equal share of every step's tasks")
    return problems


class RaySources:
    """`count` rollout sources in Ray actors feeding `buffer` (made with `shares=count`); the same calls as a
    `RolloutSource` for the trainer. `policy` must have `sampling_copy` (vLLM, or several behind the router)."""

    def __init__(self, count: int, engines: Engines, policy: Policy, renderer: Renderer, config: RolloutConfig,
                 task_at: Callable[[int], Task], buffer: GroupBuffer, *, tasks_per_step: int, seed: int,
                 start: int = 0, skip: Collection[int] = (), timeline: Timeline | None = None, restart: bool = False):
        if problems := source_problems(count, buffer.max_staleness, tasks_per_step, hasattr(policy, "sampling_copy")):
            raise ValueError("; ".join(problems))
        if len(buffer.discarded) != count:
            raise ValueError(f"the buffer must count discarded groups by {count} shares (GroupBuffer(shares=...))")
        self.count, self.policy, self.buffer, self.timeline = count, policy, buffer, timeline or Timeline()
        self._actor_settings = dict(engines=engines, renderer=renderer, config=config, task_at=task_at,
                                    max_staleness=buffer.max_staleness, tasks_per_step=tasks_per_step // count,
                                    seed=seed, start=start, skip=set(skip), restart=restart)
        self.actors: list[Any] = []
        self._pumps: list[threading.Thread] = []
        self._closing = threading.Event()
        self._runner = asyncio.Runner()  # the trainer's side of syncs, and held-out episodes, on one event loop

    def start(self) -> None:
        """Start the actors (each plays from the policy's current weight version) and the threads that drain them."""
        import ray

        actor = ray.remote(SourceActor).options(num_cpus=0, max_concurrency=4)
        self.actors = [actor.remote(policy=self.policy.sampling_copy(), share=(i, self.count),
                                    started=self.timeline.started, **self._actor_settings) for i in range(self.count)]
        ray.get([a.stats.remote() for a in self.actors])  # up, or the reason it could not start
        self._pumps = [threading.Thread(target=self._pump, args=(i,), name=f"agentrl-source-{i}", daemon=True)
                       for i in range(self.count)]
        for pump in self._pumps:
            pump.start()

    def sync(self, model: Any, version: int) -> None:
        """Pause every source, send `model`'s weights as `version` from this process, resume them. Their busy
        intervals until the pause join the timeline: cut while paused, so that what a source plays after it resumes
        is the next step's, however soon it finishes."""
        import ray

        self.buffer.check()
        ray.get([a.pause.remote() for a in self.actors])
        synced = None
        try:
            self._runner.run(self.policy.sync_weights(model, version))
            synced = version
            cuts = ray.get([a.cut.remote() for a in self.actors])
        finally:
            ray.get([a.resume.remote(synced, self.buffer.discarded[i]) for i, a in enumerate(self.actors)])
        for cut in cuts:
            self.timeline.engine.add(cut["engine"])
            self.timeline.env.add(cut["env"])

    def run(self, coroutine: Coroutine) -> Any:
        """Runs `coroutine` (a held-out evaluation's episodes) in this process; the sources play on meanwhile."""
        self.buffer.check()
        return self._runner.run(coroutine)

    @property
    def in_flight(self) -> int:
        """Groups being played now, over all sources."""
        return sum(s["in_flight"] for s in self._stats())

    @property
    def restarted(self) -> int:
        """Groups aborted at a sync and played again, over all sources."""
        return sum(s["restarted"] for s in self._stats())

    def close(self) -> None:
        """Stop the sources (episodes in flight are cancelled, their envs closed) and their actors."""
        import ray

        self._closing.set()
        for actor, closed in [(a, a.close.remote()) for a in self.actors]:
            try:
                ray.get(closed, timeout=60)
            except ray.exceptions.RayActorError:
                pass  # it died: its episodes went with it
            ray.kill(actor)
        for pump in self._pumps:
            pump.join()
        self._runner.close()

    def _stats(self) -> list[dict[str, int]]:
        import ray

        return ray.get([a.stats.remote() for a in self.actors])

    def _pump(self, i: int) -> None:
        """Drain source i into the buffer until closed; its failure, or its actor's death, fails the buffer."""
        import ray

        actor = self.actors[i]
        try:
            while not self._closing.is_set():
                for group in ray.get(actor.drain.remote(self.buffer.discarded[i])):
                    self.buffer.put(group)
        except ray.exceptions.RayActorError as e:
            if not self._closing.is_set():
                self.buffer.fail(RolloutSourceError(f"rollout source {i}'s actor died: {str(e).splitlines()[0]}"))
        except Exception as e:  # noqa: BLE001 -- the source's failure (a RolloutSourceError from the actor)
            if not self._closing.is_set():
                self.buffer.fail(e)
