"""Evaluation of a policy on a task split: success rate and mean reward over non-error episodes.

A success is an episode whose `outcome` reward component is 1 (or, for envs without one, whose reward
reaches the env's maximum). Errors are counted, never scored as failures.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any, Callable, Sequence

from agentrl.env import TextEnv
from agentrl.policy import Policy
from agentrl.renderer import Renderer
from agentrl.rollout import RolloutConfig, RolloutEngine, summarize
from agentrl.types import Task, Trajectory


def evaluate(policy: Policy, renderer: Renderer, make_env: Callable[[], TextEnv], tasks: Sequence[Task],
             config: RolloutConfig) -> tuple[dict[str, Any], list[Trajectory]]:
    """One episode per task (`config.group_size` is ignored); returns (metrics, trajectories)."""
    engine = RolloutEngine(make_env, policy, renderer, replace(config, group_size=1))
    try:
        trajectories = [g.trajectories[0] for g in asyncio.run(engine.run(tasks))]
    finally:
        engine.close()
    return summarize(trajectories, max_reward=make_env().max_reward), trajectories
