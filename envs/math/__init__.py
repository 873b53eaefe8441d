"""Arithmetic RLVR environment: word and expression problems, a calculator tool, outcome and process rewards."""

from agentrl.envs.math.env import ArithmeticEnv, calculator, outcome_reward, process_reward, step_is_correct

__all__ = ["ArithmeticEnv", "calculator", "outcome_reward", "process_reward", "step_is_correct"]
