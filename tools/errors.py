"""The two kinds of tool failure, kept apart on purpose.

- `ToolArgumentError` is the *model's* mistake (wrong argument type, missing or unknown argument). Its message
  is short and written for the model: the env shows it as an observation so the model can correct itself.
- `ToolError` is an *infrastructure* failure: the tool's own code raised, or it hung past its timeout. The
  rollout engine records it as an `error` trajectory (excluded from baselines), because the model did
  nothing wrong that it could learn from.

A tool that wants to tell the model "no results" or "bad query" returns that as text; raising means broken.
"""

from __future__ import annotations


class ToolError(RuntimeError):
    """A tool failed to run (its code raised, or it timed out). Becomes an `error` trajectory."""


class ToolTimeout(ToolError):
    """A tool ran longer than its `timeout`."""


class ToolArgumentError(ValueError):
    """The model called a tool with bad arguments. The message is meant to be shown to the model."""
