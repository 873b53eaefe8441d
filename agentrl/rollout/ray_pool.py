"""Environments on Ray: env workers as actors on any node of a cluster.

    pool = RayEnvPool("search/r1-v0", {"topk": 1}, RayConfig(workers=2))  # joins or starts a Ray cluster
    engine = RolloutEngine(pool.make, policy, renderer, RolloutConfig(...))  # the same engine, same results
    groups = asyncio.run(engine.run(tasks))

The policy stays with the driver (a vLLM server, or several behind `agentrl.policy.router.RoutedPolicy`); each
episode's env lives in one worker actor (`EnvWorker`, threaded, so that blocking tools of many episodes
overlap) and `RemoteEnv` forwards the env calls to it. An episode's env is made in the worker by id, so the
same seeds give the same trajectories as in-process envs.

A worker that dies (its process killed, its node gone) fails the calls of its episodes with `WorkerLost`, and
Ray restarts the actor (`max_restarts`). `WorkerLost` is retryable: the rollout engine plays such an episode
again from the start on the next worker, up to `RolloutConfig.retries` times, and the replay replaces the
lost play, so nothing is lost or counted twice (`metrics["attempts"]` says how many plays it took).
"""

from __future__ import annotations

import itertools
import os
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from pydantic import with_config

from agentrl.config import STRICT


@with_config(STRICT)
@dataclass(frozen=True)
class RayConfig:
    address: str | None = None  # a running cluster ("auto", "ray://host:10001"); None: start a local one
    workers: int = 2  # env worker actors
    episodes_per_worker: int = 16  # concurrent episodes (threads) in one worker
    max_restarts: int = 3  # Ray restarts a dead worker this many times
    num_cpus_per_worker: float = 0.0  # CPUs reserved per worker; 0 lets small machines run everything
    # asynchronous training: its rollout sources in this many actors (0: a thread of the trainer's process)
    sources: int = 0

    def __post_init__(self) -> None:
        for name in ("workers", "episodes_per_worker"):
            if getattr(self, name) < 1:
                raise ValueError(f"ray.{name} must be >= 1, got {getattr(self, name)}")
        if self.sources < 0:
            raise ValueError(f"ray.sources must be >= 0, got {self.sources}")


class WorkerLost(RuntimeError):
    """The env worker of this episode died; the rollout engine plays the episode again on another worker."""

    retryable = True


class EpisodeGone(LookupError):
    """Raised in a restarted worker for an episode its old process held."""


def init_ray(address: str | None = None) -> None:
    """Connects to the cluster at `address`, or starts a quiet local one; does nothing if Ray is up."""
    try:
        import ray
    except ImportError as e:
        raise ImportError("scaling out needs Ray: pip install 'agentrl[ray]'") from e
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(include_dashboard=False, log_to_driver=False, object_store_memory=256 << 20)


class EnvWorker:
    """One actor: the envs of the episodes it hosts, by episode id. Made with `ray.remote` in `RayEnvPool`."""

    def __init__(self, env_id: str, env_kwargs: dict[str, Any]):
        from agentrl.env.registry import make

        self.env_id, self.env_kwargs = env_id, env_kwargs
        self.envs: dict[str, Any] = {}
        self.opened = 0
        self._lock = threading.Lock()
        # One env made and closed before any episode: the env's imports (seconds; on a loaded machine, 16 episodes'
        # threads importing at once took 80 s) are paid here, not under the first episodes' make_env timeout, and
        # an env id or kwargs that cannot work fail the pool's start.
        make(env_id, **env_kwargs).close()

    def open(self, episode: str, kwargs: dict[str, Any]) -> None:
        """Make the env of `episode` (the worker's env kwargs updated with `kwargs`)."""
        from agentrl.env.registry import make

        env = make(self.env_id, **{**self.env_kwargs, **kwargs})
        with self._lock:
            self.envs[episode] = env
            self.opened += 1

    def call(self, episode: str, name: str, args: tuple, kwargs: dict) -> Any:
        """Call the method `name` of the env of `episode`; raises `EpisodeGone` if this worker does not hold it."""
        return getattr(self._env(episode), name)(*args, **kwargs)

    def attribute(self, episode: str, name: str) -> tuple[str, Any]:
        """("method", None) for a method, else ("value", its value)."""
        value = getattr(self._env(episode), name)
        return ("method", None) if callable(value) else ("value", value)

    def _env(self, episode: str):
        try:
            return self.envs[episode]
        except KeyError:  # Ray restarted this worker: the episode's env died with its old process
            raise EpisodeGone(f"episode {episode} is not in this worker: it restarted") from None

    def close(self, episode: str) -> None:
        """Close and forget the env of `episode`; an episode it does not hold is a no-op."""
        with self._lock:
            env = self.envs.pop(episode, None)
        if env is not None:
            env.close()

    def stats(self) -> dict[str, int]:
        """The worker's pid, how many envs it opened in all, and how many are open now."""
        return {"pid": os.getpid(), "opened": self.opened, "open": len(self.envs)}


class RayEnvPool:
    """`workers` EnvWorker actors for one env id; `make(**kwargs)` is a `make_env` for the rollout engine."""

    def __init__(self, env_id: str, env_kwargs: dict[str, Any] | None = None, config: RayConfig = RayConfig()):
        init_ray(config.address)
        import ray

        self.env_id, self.config = env_id, config
        actor = ray.remote(EnvWorker).options(num_cpus=config.num_cpus_per_worker,
                                              max_concurrency=config.episodes_per_worker,
                                              max_restarts=config.max_restarts)
        self.workers = [actor.remote(env_id, dict(env_kwargs or {})) for _ in range(config.workers)]
        ray.get([w.stats.remote() for w in self.workers])  # up before any episode starts
        self._next = itertools.count()

    def make(self, **kwargs: Any) -> "RemoteEnv":
        """A new env on the next worker, round robin (a restarted worker takes episodes again). A worker that is
        down is passed over: the rollout engine makes envs from several threads at once, so one of them can reach
        a worker between its death and its restart, and an episode that has not started loses nothing by moving.
        Each worker is tried once, from this call's own start: the shared counter moves under other threads."""
        start = next(self._next)
        for i in range(len(self.workers)):
            worker = self.workers[(start + i) % len(self.workers)]
            try:
                return RemoteEnv(self, worker, uuid.uuid4().hex, kwargs)
            except WorkerLost as e:
                lost = e
        raise lost

    def close(self) -> None:
        """Kill the worker actors (their envs go with them)."""
        import ray

        for worker in self.workers:
            ray.kill(worker)
        self.workers = []


class RemoteEnv:
    """The env of one episode, in a worker actor. Env methods and attributes are forwarded to it (values
    travel by pickling); a dead worker becomes `WorkerLost`."""

    max_concurrent_episodes = None  # the env's limit holds per process, and each worker has its own sandbox pools

    def __init__(self, pool: RayEnvPool, worker, episode: str, kwargs: dict[str, Any]):
        self._worker, self._episode = worker, episode
        self._get(worker.open.remote(episode, kwargs))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        kind, value = self._get(self._worker.attribute.remote(self._episode, name))
        return (lambda *args, **kwargs: self._call(name, args, kwargs)) if kind == "method" else value

    def reset(self, *args: Any, **kwargs: Any):
        """The env's `reset`, in the worker."""
        return self._call("reset", args, kwargs)

    def step(self, *args: Any, **kwargs: Any):
        """The env's `step`, in the worker."""
        return self._call("step", args, kwargs)

    def assistant_message(self, *args: Any, **kwargs: Any):
        """The env's `assistant_message`, in the worker."""
        return self._call("assistant_message", args, kwargs)

    def close(self) -> None:
        """Close the env in its worker; if the worker died, there is nothing left to close."""
        try:
            self._get(self._worker.close.remote(self._episode))
        except WorkerLost:
            pass  # its envs died with it

    def _call(self, name: str, args: tuple, kwargs: dict) -> Any:
        return self._get(self._worker.call.remote(self._episode, name, args, kwargs))

    def _get(self, ref) -> Any:
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            raise WorkerLost(f"env worker died: {type(e).__name__}: {str(e).splitlines()[0]}") from None
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, EpisodeGone):
                raise WorkerLost(f"env worker restarted: {e.cause}") from None
            raise e.as_instanceof_cause() from None  # the env raised: the same exception as in-process


def env_factory(env_id: str, env_kwargs: dict[str, Any], ray: RayConfig | None = None) -> Callable[..., Any]:
    """`make_env(split="train")` for a job's env with its kwargs: in this process, or in a pool of Ray workers
    when the job has [ray]. The one way a job makes its envs (`agentrl rollout`, `train`)."""
    if ray is None:
        from agentrl.env.registry import make

        return lambda split="train", **kwargs: make(env_id, split=split, **{**env_kwargs, **kwargs})
    pool = RayEnvPool(env_id, env_kwargs, ray)
    return lambda split="train", **kwargs: pool.make(split=split, **kwargs)
