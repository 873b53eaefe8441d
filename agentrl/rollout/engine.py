"""The rollout engine: many episodes at once, each an exact token trajectory.

Episodes run concurrently as asyncio tasks; the policy batches their requests; env calls (which may
block on tools) run in a thread pool with a timeout. Every episode ends as a `Trajectory` with status
ok / truncated (with the reason) / error (with the exception): `run_episode` is the one place where
exceptions become data, so a failing tool or env never stops the batch.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from pydantic import with_config

from agentrl.config import STRICT
from agentrl.env.api import TextEnv
from agentrl.policy.protocol import Policy, SamplingParams, current_episode
from agentrl.renderer import Renderer
from agentrl.types import Group, Message, Status, Task, Trajectory, Turn


@with_config(STRICT)
@dataclass(frozen=True)
class RolloutConfig:
    group_size: int = 1  # G trajectories per task, same env seed, different sampling seeds
    concurrency: int = 32  # episodes in flight
    max_turns: int = 16  # besides the env's own limit
    max_total_tokens: int = 2048  # prompt + all turns; also capped by the sampler per turn
    step_timeout: float = 60.0  # seconds for one env.reset / env.step (tools have their own timeouts)
    env_workers: int = 16  # threads for env calls
    retries: int = 2  # plays again an episode that ended in a retryable error (its Ray env worker died)
    seed: int = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        for name in ("group_size", "concurrency", "max_turns", "env_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.sampling.seed is not None:
            raise ValueError("sampling.seed: each turn's sampling seed is derived from the rollout's seed (per task, "
                             "sample and turn); set that seed instead")
        if self.sampling.n != 1:
            raise ValueError("sampling.n must be 1 in a rollout: use group_size for several samples per task")
        if self.sampling.max_tokens >= self.max_total_tokens:
            raise ValueError(f"sampling.max_tokens ({self.sampling.max_tokens}) must be below max_total_tokens "
                             f"({self.max_total_tokens}), which also holds the prompt")


def check_loop_rollout(section: str, rollout: RolloutConfig) -> None:
    """A training loop derives each collection's rollout seed from `section.seed` (distinct per step, the same on a
    resumed run): a seed set in `[section.rollout]` would be replaced, so it is an error."""
    if rollout.seed != 0:
        raise ValueError(f"{section}.rollout.seed is derived from {section}.seed (per step, the same on a resumed "
                         f"run): set {section}.seed instead")


_plays = itertools.count()  # makes every play's episode key unique, replays included


class EnvTimeout(TimeoutError):
    """env.reset or env.step took longer than `step_timeout`."""


@dataclass
class _Episode:
    """Mutable builder of one trajectory; frozen into a `Trajectory` at the end."""

    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    reward: float = 0.0
    components: dict[str, float] = field(default_factory=dict)
    tool_calls: int = 0
    answer: str | None = None  # the final answer, when the env reports one (ToolEnv does)
    untrained: int = 0  # sampled tokens that a frozen partner wrote (tandem rollouts): loss mask 0
    screenshots: list[tuple[int, str]] = field(default_factory=list)  # (turn, PNG path) of the page after it (web)

    def extend(self, ids: Sequence[int], sampled: bool, logprobs: Sequence[float] | None = None,
               trainable: Sequence[int] = ()) -> None:
        self.ids += ids
        self.mask += list(trainable) if sampled and trainable else [int(sampled)] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)


class RolloutEngine:
    """Plays episodes of envs from `make_env` (a fresh env per episode) with `policy`, rendered by `renderer`."""

    def __init__(self, make_env: Callable[[], TextEnv], policy: Policy, renderer: Renderer,
                 config: RolloutConfig = RolloutConfig()):
        self.make_env, self.policy, self.renderer, self.config = make_env, policy, renderer, config
        self._pool = ThreadPoolExecutor(config.env_workers, thread_name_prefix="agentrl-env")

    async def _call(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))
        try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation that races the result
            async with asyncio.timeout(self.config.step_timeout):
                return await future
        except TimeoutError:
            raise EnvTimeout(f"{getattr(fn, '__name__', fn)} took more than {self.config.step_timeout}s") from None

    async def run_episode(self, task: Task, env_seed: int, sample_seed: int, group: int = 0) -> Trajectory:
        """One episode. One that failed in a retryable way (an exception with `retryable = True`, such as a
        lost Ray env worker) is played again from the start, and the replay replaces it."""
        for attempt in range(1, self.config.retries + 2):
            trajectory, retryable = await self._run_once(task, env_seed, sample_seed, group)
            if not retryable:
                break
        return replace(trajectory, info={**trajectory.info, "attempts": attempt}) if attempt > 1 else trajectory

    async def _run_once(self, task: Task, env_seed: int, sample_seed: int, group: int) -> tuple[Trajectory, bool]:
        ep, env, version, retryable = _Episode(), None, self.policy.weight_version, False
        current_episode.set(f"{task.id}@{env_seed}/{sample_seed}/{next(_plays)}")
        status, reason, prompt_len = Status.OK, "", 0
        start = time.perf_counter()
        try:
            env = self.make_env()
            status, reason, prompt_len = await self._play(env, task, env_seed, sample_seed, ep)
        except Exception as e:  # the one capture point: any failure becomes an `error` trajectory
            status, reason = Status.ERROR, f"{type(e).__name__}: {e}"
            retryable = getattr(e, "retryable", False)
        finally:
            if env is not None:
                env.close()
        return Trajectory(task.id, tuple(ep.ids), tuple(ep.mask), tuple(ep.logprobs), prompt_len,
                          tuple(ep.turns), ep.reward, ep.components, status, reason, tuple(ep.messages),
                          group, env_seed, version,
                          {"tool_calls": ep.tool_calls, "answer": ep.answer,
                           "seconds": round(time.perf_counter() - start, 3),
                           **({"untrained_tokens": ep.untrained} if ep.untrained else {}),
                           **({"screenshots": ep.screenshots} if ep.screenshots else {})}), retryable

    async def _play(self, env: TextEnv, task: Task, env_seed: int, sample_seed: int,
                    ep: _Episode) -> tuple[Status, str, int]:
        cfg, r = self.config, self.renderer
        obs, info = await self._call(env.reset, seed=env_seed, options={"task": task})
        tools = info.get("tools")
        ep.messages += obs
        ep.extend(r.prompt_ids(ep.messages, tools), sampled=False)
        prompt_len = len(ep.ids)
        stop_ids = tuple(dict.fromkeys(cfg.sampling.stop_token_ids + r.stop_token_ids))
        for turn in range(cfg.max_turns):
            budget = cfg.max_total_tokens - len(ep.ids)
            if budget <= 0:
                return Status.TRUNCATED, f"max_total_tokens={cfg.max_total_tokens}", prompt_len
            sampling = replace(cfg.sampling, max_tokens=min(cfg.sampling.max_tokens, budget),
                               seed=sample_seed * 1_000_003 + turn, stop_token_ids=stop_ids)
            sample = (await self.policy.generate(ep.ids, sampling))[0]
            start = len(ep.ids)
            ep.extend(sample.token_ids, sampled=True, logprobs=sample.logprobs, trainable=sample.trainable)
            ep.untrained += len(sample.trainable) - sum(sample.trainable)
            if sample.finish_reason == "length":
                ep.turns.append(Turn(start, len(ep.ids), len(ep.ids), 0.0, "length"))
                limit = "max_total_tokens" if sampling.max_tokens < cfg.sampling.max_tokens else "max_tokens"
                return Status.TRUNCATED, f"{limit} reached mid-turn", prompt_len
            ids = sample.token_ids
            text = r.decode(ids[:-1] if ids and ids[-1] in r.stop_token_ids else ids)  # without the turn end
            obs, reward, terminated, truncated, info = await self._call(env.step, text)
            assistant = env.assistant_message(text)
            ep.reward += reward
            ep.components.update(info.get("reward_components", {}))
            ep.tool_calls += info.get("tool_calls", 0)
            ep.answer = info.get("answer", ep.answer)
            if "screenshot" in info:
                ep.screenshots.append((turn, info["screenshot"]))
            end = len(ep.ids)
            if terminated or truncated or turn + 1 == cfg.max_turns:
                ep.turns.append(Turn(start, end, end, reward))
                ep.messages += [assistant, *obs]
                if terminated:
                    return Status.OK, info.get("reason", ""), prompt_len
                return Status.TRUNCATED, info.get("reason", f"max_turns={cfg.max_turns}"), prompt_len
            ep.extend(r.observation_ids(ep.messages, assistant, obs, sample.token_ids, tools), sampled=False)
            ep.messages += [assistant, *obs]
            ep.turns.append(Turn(start, end, len(ep.ids), reward))
        raise AssertionError("unreachable: the loop returns on its last turn")

    async def run(self, tasks: Sequence[Task], on_episode: Callable[[Trajectory], None] | None = None
                  ) -> list[Group]:
        """`group_size` episodes per task; returns one Group per task, in task order."""
        cfg, gate = self.config, asyncio.Semaphore(self.config.concurrency)

        async def one(task_index: int, k: int) -> Trajectory:
            async with gate:
                env_seed = cfg.seed * 100_003 + task_index  # shared by the group
                traj = await self.run_episode(tasks[task_index], env_seed, env_seed * cfg.group_size + k, task_index)
            if on_episode:
                on_episode(traj)
            return traj

        results = await asyncio.gather(*(one(i, k) for i in range(len(tasks)) for k in range(cfg.group_size)))
        G = cfg.group_size
        return [Group(task, tuple(results[i * G:(i + 1) * G])) for i, task in enumerate(tasks)]

    def close(self) -> None:
        """Shut the env thread pool down, cancelling env calls not yet started."""
        self._pool.shutdown(wait=False, cancel_futures=True)
