"""agentrl's own environment families. Importing this package registers their ids."""

from agentrl.registration import register

register("math/arith-v0", "agentrl.envs.math:ArithmeticEnv")
