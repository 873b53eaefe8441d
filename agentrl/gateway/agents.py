"""Agent programs as rollouts: a program the user already wrote against an OpenAI client, run G times per task
through the gateway, its sessions' segments the group's trajectories.

    async def program(task: Task, base_url: str) -> float | None     (or a plain function: it runs in a thread)

The program points its client at `base_url` (`openai.AsyncOpenAI(base_url=base_url, api_key="agentrl")`), runs
its agent on `task.data`, and returns the reward, or posts it to the session (`POST` to `base_url` with `/v1`
replaced by `/reward`) and returns None. A program that raises, times out or ends without a reward gives `error`
trajectories with the reason.

`AgentEngine` has the rollout engine's interface (`run`, `run_group`, `run_episode`, `close`, `aclose`, `with`), so the
training loop, synchronous or asynchronous, takes its groups as it takes env groups (`AgentEngines`), and held-out
evaluation (`agentrl.eval.run.run_suite`) its episodes.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Self, Sequence

import uvicorn
from pydantic import with_config

from agentrl.config import STRICT
from agentrl.gateway.app import create_app
from agentrl.gateway.sessions import Gateway, GatewayConfig, Session
from agentrl.policy.protocol import Policy
from agentrl.renderer import Renderer
from agentrl.rollout import seeds
from agentrl.rollout.engine import RolloutConfig, captured, describe, within
from agentrl.rollout.timeline import Timeline
from agentrl.system.tcp import listening_socket
from agentrl.types import Group, StopReason, Task, Trajectory

Program = Callable[[Task, str], "Awaitable[float | None] | float | None"]


@with_config(STRICT)
@dataclass(frozen=True)
class AgentConfig:
    """`[agent]`: the program to train, how its replies are parsed, how long one run may take, and the reward that
    counts as success. The rollout's settings (`[grpo.rollout]`) give the group size, the concurrency, the token
    budgets and the sampling of calls that set none."""

    program: str  # "module:function", importable from the working directory
    tool_parser: str = "hermes"  # as GatewayConfig's
    reasoning: bool = False  # as GatewayConfig's
    timeout: float = 600.0  # seconds for one run of the program
    max_reward: float = 1.0  # success, in metrics

    def __post_init__(self) -> None:
        load_program(self.program)  # a program that cannot be imported fails here, before any work
        GatewayConfig(tool_parser=self.tool_parser)
        if not self.timeout > 0:
            raise ValueError(f"agent.timeout must be > 0 seconds, got {self.timeout}")


def load_program(spec: str) -> Program:
    """The function named by "module:function"."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"agent.program must be 'module:function', got {spec!r}")
    if os.getcwd() not in sys.path:  # `agentrl` runs from its script's folder, not the recipe's
        sys.path.insert(0, os.getcwd())
    try:
        program = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"agent.program {spec!r} cannot be loaded: {e} (is its folder on PYTHONPATH?)") from e
    if not callable(program):
        raise ValueError(f"agent.program {spec!r} is not a function")
    return program


ENDED_GRACE = 5.0  # seconds a coroutine program may run on after the gateway ended its session


class ProgramError(RuntimeError):
    """The agent program raised, timed out, or gave no reward."""


class AgentEngine:
    """Runs `program` on tasks through a gateway over `policy`, served on a free local port while episodes run."""

    def __init__(self, program: Program, policy: Policy, renderer: Renderer, config: RolloutConfig,
                 agent: AgentConfig, timeline: Timeline | None = None):
        self.program, self.config, self.agent = program, config, agent
        sampling = config.sampling  # the rollout's, for what a request leaves out
        gateway = GatewayConfig(tool_parser=agent.tool_parser, reasoning=agent.reasoning,
                                max_tokens=sampling.max_tokens, max_total_tokens=config.max_total_tokens,
                                max_calls=config.max_turns,
                                temperature=sampling.temperature, top_p=sampling.top_p,
                                session_timeout=agent.timeout * 2)
        self.gateway = Gateway(policy, renderer, gateway, timeline)
        self._server: uvicorn.Server | None = None
        self._serving: asyncio.Task | None = None
        self.url = ""

    async def _serve(self) -> None:
        """Starts the gateway's server on this event loop, if it is not running on it."""
        if self._serving is not None and not self._serving.done() and \
                self._serving.get_loop() is asyncio.get_running_loop():
            return
        sock = listening_socket()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(create_app(self.gateway), log_level="warning", lifespan="off"))
        self._serving = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._serving.done():
                self._serving.result()  # its failure
            await asyncio.sleep(0.005)

    async def _stop(self) -> None:
        if self._server is not None and self._serving is not None:
            self._server.should_exit = True
            await self._serving
            self._server = self._serving = None

    async def run_episode(self, task: Task, env_seed: int, sample_seed: int, group: int = 0) -> Trajectory:
        """One run of the program as one episode, for evaluation: its first segment stands for the run (every
        segment of a session carries the session's reward and status)."""
        await self._serve()
        return (await self.run_session(task, env_seed, group, sample=group, seed=sample_seed))[0]

    async def run_session(self, task: Task, env_seed: int, group: int, sample: int, seed: int
                          ) -> tuple[Trajectory, ...]:
        """One run of the program: its session's segments (error trajectories if the run failed); `seed` seeds its
        calls' sampling (with `seeded_sampling`)."""
        session = self.gateway.open(task.id, group, {"sample": sample, "seed": env_seed},
                                    seed=seed if self.config.seeded_sampling else None)
        base_url = f"{self.url}/sessions/{session.id}/v1"
        reward, error = await captured(within(self.agent.timeout, self._run(session, task, base_url), ProgramError(
            f"the agent program took more than {self.agent.timeout:g}s (agent.timeout)")))
        if session.trajectories is None:  # not closed by a posted reward
            if error is None and reward is None:
                error = ProgramError("the agent program returned no reward and posted none")
            elif error is None and not (isinstance(reward, (int, float)) and math.isfinite(reward)):
                error = ProgramError(f"the agent program returned {reward!r}, not a finite number")
            if error is not None:
                self.gateway.close(session.id, error=f"agent program: {describe(error)}", stop=StopReason.ENV_ERROR)
            else:
                self.gateway.close(session.id, float(reward))
        trajectories = tuple(self.gateway.pop(session.id))
        if not trajectories:  # the program made no call: nothing to train, one error to count
            reason = session.error or "the agent program made no model call"
            trajectories = (Trajectory(task_id=task.id, token_ids=(), loss_mask=(), logprobs=(), prompt_len=0, turns=(),
                                       reward=0.0, stop=StopReason.ENV_ERROR, reason=reason, group=group,
                                       seed=env_seed, session=session.id),)
        return trajectories

    async def _run(self, session: Session, task: Task, base_url: str) -> Any:
        """The program's result. Once the gateway has ended its session (max_turns, a flood), what it returns no
        longer counts: a coroutine program still running `ENDED_GRACE` s later is cancelled; a plain function (a
        thread, which cannot be stopped) is waited for, as its next call is refused (409) and its client raises."""
        if not inspect.iscoroutinefunction(self.program):
            return await asyncio.to_thread(self.program, task, base_url)
        run, ended = asyncio.ensure_future(self.program(task, base_url)), asyncio.ensure_future(session.closed.wait())
        try:
            await asyncio.wait({run, ended}, return_when=asyncio.FIRST_COMPLETED)
            if not run.done():
                await asyncio.wait({run}, timeout=ENDED_GRACE)
            return await run if run.done() else None
        finally:
            for future in (run, ended):
                future.cancel()

    async def run_group(self, task: Task, env_seed: int, group: int, gate: asyncio.Semaphore) -> Group:
        """`group_size` runs of the program on `task`, each holding `gate` while it runs."""
        await self._serve()

        async def one(k: int) -> tuple[Trajectory, ...]:
            async with gate:
                return await self.run_session(task, env_seed, group, k,
                                              seeds.sample_seed(env_seed, self.config.group_size, k))

        runs = await asyncio.gather(*(one(k) for k in range(self.config.group_size)))
        return Group(task, tuple(t for run in runs for t in run))

    async def run(self, tasks: Sequence[Task]) -> list[Group]:
        """`group_size` runs per task (`run_group`), seeded by the task's index; one Group per task, in task order (the
        server stops at the end)."""
        gate = asyncio.Semaphore(self.config.concurrency)
        try:
            await self._serve()
            return list(await asyncio.gather(*(self.run_group(task, seeds.episode_seed(self.config.seed, i), i, gate)
                                               for i, task in enumerate(tasks))))
        finally:
            await self._stop()

    def close(self) -> None:
        """Ask a server still running (in an asynchronous source's loop) to stop; closing again does nothing more."""
        if self._server is not None:
            self._server.should_exit = True

    async def aclose(self) -> None:
        """Stop the server, on the loop it runs on, and wait until it has."""
        await self._stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class AgentEngines:
    """The training loop's engine factory for `agent`'s program (`trainers.loop.run(engines=...)`)."""

    agent: AgentConfig

    @property
    def max_reward(self) -> float:
        """The reward that counts as success."""
        return self.agent.max_reward

    def __call__(self, policy: Policy, renderer: Renderer, config: RolloutConfig,
                 timeline: Timeline | None = None) -> AgentEngine:
        return AgentEngine(load_program(self.agent.program), policy, renderer, config, self.agent, timeline)
