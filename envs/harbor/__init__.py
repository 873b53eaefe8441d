"""Harbor tasks (the task format of Terminal-Bench, SkyRL, rLLM, TRL and others): a folder with an instruction, a
Dockerfile, tests that write a reward and a gold solution, played in the task's own image and graded by its tests."""

from agentrl.envs.harbor.env import HarborEnv

__all__ = ["HarborEnv"]
