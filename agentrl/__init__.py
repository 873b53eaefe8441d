"""agentrl: train tool-using LLM agents with reinforcement learning.

    import agentrl
    env = agentrl.make("math/arith-v0")
    obs, info = env.reset(seed=0)
"""

from agentrl.env.api import TextEnv, ToolEnv
from agentrl.env.registry import check, make, register, registry
from agentrl.env.suites import Suite, SuiteEntry, register_suite
from agentrl.env.venvs import Venv
from agentrl.types import Group, Message, Status, Task, ToolCall, Trajectory, Turn

__all__ = ["TextEnv", "ToolEnv", "check", "make", "register", "registry", "Suite", "SuiteEntry", "register_suite", "Venv",
           "Group", "Message", "Status", "Task", "ToolCall", "Trajectory", "Turn"]
