"""Code environments: program synthesis in a Docker sandbox, with hidden tests (HumanEval, generated)."""

from agentrl.envs.code.env import CodeEnv

__all__ = ["CodeEnv"]
