"""Sandboxes for running model-written code: one small runtime interface, a Docker runtime (the real
one), a local subprocess runtime (not isolated; tests and trusted code), and a warm pool."""

from agentrl.tools.sandbox.runtime import Limits, LocalRuntime, RunResult, Runtime, SandboxError

__all__ = ["Limits", "LocalRuntime", "RunResult", "Runtime", "SandboxError"]
