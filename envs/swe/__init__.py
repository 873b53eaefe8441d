"""SWE environments: repository-level bug fixing in the Docker sandbox, SWE-bench compatible, with tasks
generated offline from real repositories by bug injection."""

from agentrl.envs.swe.env import SWEEnv

__all__ = ["SWEEnv"]
