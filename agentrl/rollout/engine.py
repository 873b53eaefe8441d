"""The rollout engine: many episodes at once, each an exact token trajectory.

Episodes run concurrently as asyncio tasks; the policy batches their requests. Every env call (`make_env`,
`reset`, `step`, `assistant_message`, `close`) runs in a thread pool under `step_timeout`, and each `generate`
under `generate_timeout`, so that no env or policy can hold the event loop, and with it the other episodes.
Every episode ends as a `Trajectory` with status ok / truncated (with the reason) / error (with the exception), so
that a failing tool or env never stops the batch. Each side fails as its own type, raised where the engine calls it:
`EnvError` around an env call, `SamplingError` around `policy.generate`, the renderer's `RendererError`; `_run_once`
is the one place where an exception (`captured`) becomes the trajectory's stop reason (`stop_reason`).
"""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable, ClassVar, Protocol, Self, Sequence, TypeVar

from pydantic import with_config

from agentrl.config import STRICT, ConfigError
from agentrl.env.api import TextEnv
from agentrl.policy.protocol import Policy, PolicyError, Sample, SamplingParams, current_episode
from agentrl.renderer import Renderer, RendererError
from agentrl.rollout import seeds
from agentrl.rollout.context import ContextConfig, latest_turns, resumed, with_request
from agentrl.rollout.episode import EpisodeBuilder
from agentrl.rollout.timeline import Timeline
from agentrl.types import Group, Message, StopReason, Task, Trajectory, Turn


@with_config(STRICT)
@dataclass(frozen=True)
class RolloutConfig:
    group_size: int = 1  # G trajectories per task, same env seed, different sampling seeds
    concurrency: int = 32  # episodes in flight
    max_turns: int = 16  # besides the env's own limit
    max_total_tokens: int = 2048  # prompt + all turns; also capped by the sampler per turn
    step_timeout: float = 60.0  # seconds for one env call: make_env, reset, step, close (tools have their own timeouts)
    # seconds for one policy.generate, waiting for its batch included: a hung backend ends the episode as
    # policy_error; above VLLMPolicy's own request timeout (600 s), so that its error comes first
    generate_timeout: float = 1800.0
    # characters kept of each observation message (head and tail, the cut stated in it) before it is tokenized:
    # a tool that returns 100 MB would take minutes to tokenize, and overflow the episode's token budget anyway
    max_observation_chars: int = 100_000
    env_workers: int = 16  # threads for env calls
    retries: int = 2  # plays again an episode that ended in a retryable error (its Ray env worker died)
    seed: int = 0  # env resets and (with seeded_sampling) each turn's sampling seed derive from it
    # send each turn's seed to the engine: the same seed samples the same episode. vLLM samples seeded requests one
    # by one, so GPU training runs set false (the batch is sampled at once; resets stay seeded)
    seeded_sampling: bool = True
    sampling: SamplingParams = field(default_factory=SamplingParams)
    context: ContextConfig = field(default_factory=ContextConfig)  # when the conversation outgrows its window

    def __post_init__(self) -> None:
        for name in ("group_size", "concurrency", "max_turns", "env_workers", "max_observation_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("step_timeout", "generate_timeout"):
            if not getattr(self, name) > 0:  # also refuses NaN
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.sampling.seed is not None:
            raise ValueError("sampling.seed: each turn's sampling seed is derived from the rollout's seed (per task, "
                             "sample and turn); set that seed instead")
        if self.sampling.n != 1:
            raise ValueError("sampling.n must be 1 in a rollout: use group_size for several samples per task")
        if self.sampling.max_tokens >= self.max_total_tokens:
            raise ValueError(f"sampling.max_tokens ({self.sampling.max_tokens}) must be below max_total_tokens "
                             f"({self.max_total_tokens}), which also holds the prompt")
        self.context.check(self.max_total_tokens, self.sampling.max_tokens)

    @property
    def window(self) -> int:
        """The most tokens one trajectory holds: a segment's window, or the whole episode's budget."""
        return self.context.window or self.max_total_tokens

    def at_temperature(self, temperature: float) -> RolloutConfig:
        """This rollout, sampling at `temperature`."""
        return replace(self, sampling=replace(self.sampling, temperature=temperature))


def evaluation_temperature(table: object, where: str) -> None:
    """An evaluation's temperature is its `temperature` key (greedy by default), which its rollout samples at: a
    table whose `rollout.sampling.temperature` says another is refused rather than overruled."""
    if not isinstance(table, dict):
        return  # a malformed table, which validation names
    rollout = table.get("rollout")
    sampling = rollout.get("sampling") if isinstance(rollout, dict) else None
    if isinstance(sampling, dict) and sampling.get("temperature", table.get("temperature", 0.0)) != \
            table.get("temperature", 0.0):
        raise ConfigError(f"{where}rollout.sampling.temperature: an evaluation samples at its own temperature; set "
                          f"{where}temperature instead")


_plays = itertools.count()  # makes every play's episode key unique, replays included
T = TypeVar("T")


class EnvTimeout(TimeoutError):
    """An env call (make_env, reset, step, close) took longer than `step_timeout`."""


class EnvRaised(RuntimeError):
    """Env code raised what is not an ordinary exception (KeyboardInterrupt, SystemExit, GeneratorExit, ...)
    or cannot cross into the event loop (StopIteration); this carries its type and message instead."""


class PolicyTimeout(PolicyError):
    """`policy.generate` took longer than `generate_timeout`."""


class EpisodeError(Exception):
    """One side of an episode failed: raised by the engine where it calls that side, from what that side raised
    (`cause`). The class says whose failure it was, and so the trajectory's stop reason; the cause says why."""

    stop: ClassVar[StopReason]

    def __init__(self, cause: Exception):
        super().__init__(describe(cause))
        self.cause = cause


class EnvError(EpisodeError):
    """An env call (`make_env`, `reset`, `step`, `assistant_message`, `close`) raised, or ran past `step_timeout`."""

    stop = StopReason.ENV_ERROR


class SamplingError(EpisodeError):
    """Sampling a turn failed: `policy.generate` raised (a backend's `PolicyError`, or anything else), or ran past
    `generate_timeout`."""

    stop = StopReason.POLICY_ERROR


async def captured(work: Awaitable[T]) -> tuple[T | None, Exception | None]:
    """The one capture point: `work`'s result and None, or None and the exception it raised. An episode's play
    and its env's close pass here, so that any failure becomes data: an `error` trajectory, or a close error in
    its info. Cancellation (a real Ctrl-C) is no exception here: it still stops the batch."""
    try:
        return await work, None
    except Exception as e:  # env, tool, policy or renderer: whatever failed, the batch goes on
        return None, e


def cause(error: Exception) -> Exception:
    """What failed: an `EpisodeError`'s cause, or any other exception itself."""
    return error.cause if isinstance(error, EpisodeError) else error


def stop_reason(error: Exception) -> StopReason:
    """The stop reason of an episode that raised `error`: render_error for a `RendererError` (the template's limit,
    whoever rendered), else the side an `EpisodeError` names; anything else is env_error, as the engine then failed
    on what the env gave it (an observation or an info it cannot read)."""
    if isinstance(cause(error), RendererError):
        return StopReason.RENDER_ERROR
    return error.stop if isinstance(error, EpisodeError) else StopReason.ENV_ERROR


QUEUE_TIMEOUTS = 10  # an env call waits for a free thread at most this many step timeouts


async def within(seconds: float, work: Awaitable[T], timeout: Exception) -> T:
    """`work`'s result, or `timeout` raised once it has run `seconds` (a TimeoutError of its own passes as is)."""
    try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation that races the result
        async with asyncio.timeout(seconds) as scope:
            return await work
    except TimeoutError:
        if scope.expired():
            raise timeout from None
        raise


def _in_worker(name: str, fn: Callable[..., T], args: tuple, kwargs: dict) -> T:
    """`fn(*args, **kwargs)` in an env thread; what it raises comes out as `EnvError`, around an `EnvRaised` for what
    the event loop cannot take. A KeyboardInterrupt here is the env's own: a real Ctrl-C reaches the main thread
    only."""
    try:
        return fn(*args, **kwargs)
    except BaseException as e:
        if isinstance(e, Exception) and not isinstance(e, StopIteration):
            raise EnvError(e) from e
        raise EnvError(EnvRaised(f"{type(e).__name__} in {name}: {e}")) from e


def describe(error: Exception) -> str:
    """`error` as a trajectory's reason: "<ExceptionType>: <message>"."""
    return f"{type(error).__name__}: {error}"


def _capped(observation: Sequence[Message], limit: int) -> tuple[Message, ...]:
    """`observation` with each message's content cut to `limit` characters: its head and tail, and a line that
    says how much was cut (as the sandbox runner cuts program output)."""
    def cut(text: str) -> str:
        head = limit // 2
        return (f"{text[:head]}\n[... {len(text) - limit} characters cut: the rollout keeps {limit} of an "
                f"observation (max_observation_chars) ...]\n{text[len(text) - (limit - head):]}")

    return tuple(m if len(m.content) <= limit else replace(m, content=cut(m.content)) for m in observation)


class RolloutEngine:
    """Plays episodes of envs from `make_env` (a fresh env per episode) with `policy`, rendered by `renderer`;
    `timeline`, when given, records when the policy and the envs were busy. `with RolloutEngine(...) as engine:`
    closes it at the end."""

    def __init__(self, make_env: Callable[[], TextEnv], policy: Policy, renderer: Renderer,
                 config: RolloutConfig = RolloutConfig(), timeline: Timeline | None = None):
        self.make_env, self.policy, self.renderer, self.config = make_env, policy, renderer, config
        self.timeline = timeline or Timeline()
        self._pool = ThreadPoolExecutor(config.env_workers, thread_name_prefix="agentrl-env")
        self._stop_ids = tuple(dict.fromkeys(config.sampling.stop_token_ids + renderer.stop_token_ids)) \
            if renderer is not None else ()
        self._env_slots: asyncio.Semaphore | None = None  # the env's max_concurrent_episodes, made at the first reset

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """An env call, in the env thread pool under `step_timeout`, counted from when a thread starts it (a call
        that overruns is abandoned). The wait for a free thread is bounded apart: abandoned calls keep theirs. What
        the call raises, and either timeout, comes out as `EnvError`."""
        name = "make_env" if fn is self.make_env else getattr(fn, "__name__", repr(fn))
        loop, started = asyncio.get_running_loop(), asyncio.Event()

        def run() -> T:
            loop.call_soon_threadsafe(started.set)
            with self.timeline.env:
                return _in_worker(name, fn, args, kwargs)

        future = asyncio.ensure_future(loop.run_in_executor(self._pool, run))
        timeout, queued = self.config.step_timeout, QUEUE_TIMEOUTS * self.config.step_timeout
        try:
            await within(queued, started.wait(), EnvError(EnvTimeout(
                f"no env thread was free for {name} within {queued:g}s: all {self.config.env_workers} "
                "(rollout.env_workers) are busy, some maybe with abandoned calls; raise env_workers")))
        except BaseException:
            future.cancel()  # still queued: it never starts
            raise
        return await within(timeout, future, EnvError(EnvTimeout(
            f"{name} took more than {timeout}s (rollout.step_timeout)")))

    async def run_episode(self, task: Task, env_seed: int, sample_seed: int, group: int = 0) -> Trajectory:
        """One episode, as its last segment (which holds its end; the episode's totals are in its metrics)."""
        return (await self.run_segments(task, env_seed, sample_seed, group))[-1]

    async def run_segments(self, task: Task, env_seed: int, sample_seed: int, group: int = 0
                           ) -> tuple[Trajectory, ...]:
        """One episode: its trajectories, one per segment (a single one unless a context policy started new
        segments). One that failed in a retryable way (an exception with `retryable = True`, such as a lost Ray env
        worker) is played again from the start, and the replay replaces it."""
        for attempt in range(1, self.config.retries + 2):
            segments, retryable = await self._run_once(task, env_seed, sample_seed, group)
            if not retryable:
                break
        return tuple(replace(t, metrics={**t.metrics, "attempts": attempt}) for t in segments) if attempt > 1 else \
            tuple(segments)

    async def _run_once(self, task: Task, env_seed: int, sample_seed: int, group: int
                        ) -> tuple[list[Trajectory], bool]:
        ep = EpisodeBuilder(task, group, env_seed, self.policy.weight_version,
                            key=f"{task.id}@{env_seed}/{sample_seed}/{next(_plays)}")
        current_episode.set(ep.key)
        try:
            outcome, error = await captured(self._play(sample_seed, ep))
        finally:  # on cancellation too: the env's sandbox or browser goes back
            if ep.env is not None:
                _, close_error = await captured(self._call(ep.env.close))
                ep.close_error = describe(cause(close_error)) if close_error else None
            if ep.slot is not None:
                ep.slot.release()
        if error is not None:  # the one place where an exception becomes the trajectory's stop reason
            stop, error = stop_reason(error), cause(error)
            outcome = stop, describe(error)
        return ep.freeze(*outcome), getattr(error, "retryable", False)

    async def _play(self, sample_seed: int, ep: EpisodeBuilder) -> tuple[StopReason, str]:
        """Makes the episode's env and plays turns until it ends the episode or a budget runs out; returns why it
        stopped."""
        cfg = self.config
        await self._reset(ep)
        for turn in range(cfg.max_turns):
            if self._room(ep) <= 0:
                return self._budget_spent()
            budget_cut = self._room(ep) < cfg.sampling.max_tokens
            start, sample = len(ep.ids), await self._sample_turn(ep, seeds.turn_seed(sample_seed, turn))
            if sample.finish_reason == "length":
                end = len(ep.ids)
                ep.turns.append(Turn(start, end, end, 0.0, "length", sample.weight_version))
                cut = StopReason.MAX_TOTAL_TOKENS if budget_cut else StopReason.MAX_TOKENS
                return cut, f"{cut.value} reached mid-turn"
            stop = await self._step(ep, turn, start, sample, sample_seed)
            if stop is not None:
                return stop
        return StopReason.MAX_TURNS, f"max_turns={cfg.max_turns}"

    def _room(self, ep: EpisodeBuilder) -> int:
        """The tokens the next sample may take: what is left of the segment's window and of the episode's budget."""
        return min(self.config.window - len(ep.ids), self.config.max_total_tokens - ep.total)

    async def _reset(self, ep: EpisodeBuilder) -> None:
        """Makes the episode's env and resets it to the episode's task; its first messages become the prompt."""
        env = ep.env = await self._call(self.make_env)
        if (limit := getattr(env, "max_concurrent_episodes", None)) is not None:  # waits in the loop, not a thread
            self._env_slots = self._env_slots or asyncio.Semaphore(limit)
            await self._env_slots.acquire()
            ep.slot = self._env_slots
        obs, info = await self._call(env.reset, seed=ep.env_seed, options={"task": ep.task})
        ep.tools = info.get("tools")
        ep.messages += _capped(obs, self.config.max_observation_chars)
        ep.extend(await asyncio.to_thread(self.renderer.prompt_ids, ep.messages, ep.tools), sampled=False)
        ep.prompt_len, ep.task_len = len(ep.ids), len(ep.messages)

    async def _sample_turn(self, ep: EpisodeBuilder, seed: int, max_tokens: int | None = None) -> Sample:
        """The policy's next turn (at most `max_tokens`, by default the sampling's), within what is left of the
        segment's window and the episode's budget, appended to `ep`, with the weight version that sampled it."""
        most = self.config.sampling.max_tokens if max_tokens is None else max_tokens
        sampling = replace(self.config.sampling, max_tokens=min(most, self._room(ep)),
                           seed=seed if self.config.seeded_sampling else None, stop_token_ids=self._stop_ids)
        timeout = self.config.generate_timeout
        try:
            version = self.policy.weight_version
            with self.timeline.engine:
                sample = (await within(timeout, self.policy.generate(ep.ids, sampling), PolicyTimeout(
                    f"generate took more than {timeout}s: raise rollout.generate_timeout if the backend is slow, "
                    "not hung")))[0]
            if sample.weight_version is None:  # no sync can come between (synchronous training)
                sample = replace(sample, weight_version=version)
        except Exception as e:  # whatever the policy raised (a backend's own error or not): the policy's failure
            raise SamplingError(e) from e
        ep.extend(sample.token_ids, sampled=True, logprobs=sample.logprobs, trainable=sample.trainable)
        return sample

    async def _step(self, ep: EpisodeBuilder, turn: int, start: int, sample: Sample, sample_seed: int
                    ) -> tuple[StopReason, str] | None:
        """The sampled turn (`ep.ids[start:]`) through `env.step`: its reward recorded and, unless the episode ends
        here, the observation's tokens appended for the next turn (in a new segment when the window is full).
        Returns why the episode stops here, if it does."""
        cfg, r, end, ids = self.config, self.renderer, len(ep.ids), sample.token_ids
        text = r.decode(ids[:-1] if ids and ids[-1] in r.stop_token_ids else ids)  # without the turn end
        obs, reward, terminated, truncated, info = await self._call(ep.env.step, text)
        obs = _capped(obs, cfg.max_observation_chars)
        ep.record(turn, reward, info)
        if info.get("untrained"):  # a turn the env keeps out of training (ReflexionEnv's note)
            ep.mask[start:end] = [0] * (end - start)
        # the turn as the env parsed it (once, in `step`), for the template; an env whose own `step` does not hand
        # it back is asked for it apart
        assistant = info["assistant"] if "assistant" in info else await self._call(ep.env.assistant_message, text)
        if terminated or truncated or turn + 1 == cfg.max_turns:
            ep.messages += [assistant, *obs]
            ep.turns.append(Turn(start, end, end, reward, weight_version=sample.weight_version))
            return ((StopReason.TERMINATED, info.get("reason", "")) if terminated else
                    (StopReason.ENV_TRUNCATED, info.get("reason", "the env truncated the episode")) if truncated else
                    (StopReason.MAX_TURNS, f"max_turns={cfg.max_turns}"))
        # rendered in a thread: a long conversation takes a while to template and tokenize
        delta = await asyncio.to_thread(r.observation_ids, ep.messages, assistant, obs, ids, ep.tools)
        room = cfg.window - len(ep.ids) - len(delta) - cfg.sampling.max_tokens  # after the next turn
        if cfg.context.policy == "compact":  # and after a summary there, should its observation be as long
            request = with_request(obs, cfg.context.summary_prompt)
            asking = await asyncio.to_thread(r.observation_ids, ep.messages, assistant, request, ids, ep.tools)
            room -= len(asking) + cfg.context.summary_tokens
        if cfg.context.policy == "truncate" or room >= 0:
            if len(delta) >= self._room(ep):  # no token would be left to sample after the observation
                ep.messages += [assistant, *obs]
                ep.turns.append(Turn(start, end, end, reward, weight_version=sample.weight_version))
                return self._budget_spent()
            ep.extend(delta, sampled=False)  # the next turn starts after the observation
            ep.exchanges.append(len(ep.messages))
            ep.messages += [assistant, *obs]
            ep.turns.append(Turn(start, end, len(ep.ids), reward, weight_version=sample.weight_version))
            return None
        if cfg.context.policy == "sliding_window":
            ep.turns.append(Turn(start, end, end, reward, weight_version=sample.weight_version))
            return await self._slide(ep, assistant, obs)
        return await self._compact(ep, Turn(start, end, end, reward, weight_version=sample.weight_version),
                                   [assistant, *request], asking, seeds.turn_seed(sample_seed,
                                                                                  cfg.max_turns + len(ep.closed)))

    def _window_full(self, what: str) -> tuple[StopReason, str]:
        return StopReason.MAX_TOTAL_TOKENS, f"the context window ({self.config.window} tokens) cannot hold {what}"

    def _budget_spent(self) -> tuple[StopReason, str]:
        return StopReason.MAX_TOTAL_TOKENS, f"max_total_tokens={self.config.max_total_tokens}"

    async def _slide(self, ep: EpisodeBuilder, assistant: Message, obs: Sequence[Message]
                     ) -> tuple[StopReason, str] | None:
        """sliding_window: the next segment holds the task and the latest turns that fit, the observation included."""
        turns = [ep.messages[a:b] for a, b in zip(ep.exchanges, [*ep.exchanges[1:], len(ep.messages)])]
        ep.messages.append(assistant)  # the segment's conversation ends with its last sampled turn

        def fits(messages: list[Message]) -> list[int] | None:
            ids = self.renderer.prompt_ids(messages, ep.tools)
            return ids if len(ids) + self.config.sampling.max_tokens <= self.config.window else None

        found = await asyncio.to_thread(latest_turns, ep.messages[:ep.task_len], [*turns, [assistant, *obs]], fits)
        if found is None:
            return self._window_full("the task and the latest turn")
        messages, ids, kept = found
        if ep.total + len(ids) >= self.config.max_total_tokens:
            return self._budget_spent()
        ep.new_segment(messages, ids, list(itertools.accumulate((len(t) for t in kept[:-1]), initial=ep.task_len)))
        return None

    async def _compact(self, ep: EpisodeBuilder, turn: Turn, exchange: Sequence[Message], asking: Sequence[int],
                       seed: int) -> tuple[StopReason, str] | None:
        """compact: the turn's observation comes with the request for a summary (`exchange`, rendered: `asking`),
        which the policy writes as one more turn (sampled, trained); the next segment starts from the task and the
        summary."""
        ctx, r = self.config.context, self.renderer
        if self._room(ep) - len(asking) < 1:  # say which ran out: the segment's window or the episode's budget
            ep.turns.append(turn)
            window_short = self.config.window - len(ep.ids) - len(asking) < 1
            return self._window_full("the summary request") if window_short else self._budget_spent()
        ep.extend(asking, sampled=False)
        ep.messages += exchange
        ep.turns.append(replace(turn, obs_end=len(ep.ids)))
        start, sample = len(ep.ids), await self._sample_turn(ep, seed, ctx.summary_tokens)
        ep.turns.append(Turn(start, len(ep.ids), len(ep.ids), 0.0, sample.finish_reason, sample.weight_version))
        ep.summary_tokens.append(len(ep.ids) - start)
        ids = sample.token_ids
        summary = r.decode(ids[:-1] if ids and ids[-1] in r.stop_token_ids else ids)
        ep.messages.append(Message("assistant", summary))
        messages = resumed(ep.messages[:ep.task_len], summary, ctx.resume_prompt)
        prompt = await asyncio.to_thread(r.prompt_ids, messages, ep.tools)
        if len(prompt) + self.config.sampling.max_tokens > self.config.window:
            return self._window_full("the task and the summary")
        if ep.total + len(prompt) >= self.config.max_total_tokens:
            return self._budget_spent()
        ep.new_segment(messages, prompt, [])
        return None

    async def run(self, tasks: Sequence[Task], on_episode: Callable[[Trajectory], None] | None = None,
                  positions: Sequence[int] | None = None) -> list[Group]:
        """`group_size` episodes per task (`run_group`); returns one Group per task, in task order. A task's seeds
        and group index come from its position: its index in `tasks`, or `positions[i]` (its place in a larger
        list, so that a subset replays the seeds the whole list would draw)."""
        gate = asyncio.Semaphore(self.config.concurrency)
        positions = range(len(tasks)) if positions is None else positions
        return list(await asyncio.gather(*(
            self.run_group(task, seeds.episode_seed(self.config.seed, position), position, gate, on_episode)
            for task, position in zip(tasks, positions, strict=True))))

    async def run_group(self, task: Task, env_seed: int, group: int, gate: asyncio.Semaphore,
                        on_episode: Callable[[Trajectory], None] | None = None) -> Group:
        """`group_size` episodes of `task` from `env_seed`, each holding `gate` while it plays; `group` is the
        trajectories' group index (the task's position in the stream); `on_episode` gets each trajectory (every
        segment of an episode) as its episode ends."""
        async def one(k: int) -> tuple[Trajectory, ...]:
            async with gate:
                sample_seed = seeds.sample_seed(env_seed, self.config.group_size, k)
                segments = await self.run_segments(task, env_seed, sample_seed, group)
            for trajectory in segments if on_episode else ():
                on_episode(trajectory)
            return segments

        episodes = await asyncio.gather(*(one(k) for k in range(self.config.group_size)))
        return Group(task, tuple(t for segments in episodes for t in segments))

    def close(self) -> None:
        """Shut the env thread pool down, cancelling env calls not yet started; closing again does nothing more."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def aclose(self) -> None:
        """`close`, from a loop (as agent engines, which stop their server, need)."""
        self.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Engines(Protocol):
    """What the training loop and evaluation make engines with (`run`, `run_group`, `run_episode`, `close`, `aclose`
    and `with`, as `RolloutEngine`'s): `EnvEngines` for envs, `agentrl.gateway.agents.AgentEngines` for agent
    programs."""

    @property
    def max_reward(self) -> float:
        """The reward that counts as success."""
        ...

    def __call__(self, policy: Policy, renderer: Renderer, config: RolloutConfig,
                 timeline: Timeline | None = None) -> Any:
        ...


@dataclass(frozen=True)
class EnvEngines:
    """The training loop's engine factory for envs from `make_env`: a `RolloutEngine` per use, on the policy it is
    given (the asynchronous source gives its version-stamping wrapper). `agentrl.gateway.agents.AgentEngines` is the
    other kind: agent programs through the gateway."""

    make_env: Callable[[], TextEnv]

    @property
    def max_reward(self) -> float:
        """The env's reward that counts as success."""
        return self.make_env().max_reward

    def __call__(self, policy: Policy, renderer: Renderer, config: RolloutConfig,
                 timeline: Timeline | None = None) -> RolloutEngine:
        return RolloutEngine(self.make_env, policy, renderer, config, timeline)
