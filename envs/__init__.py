"""agentrl's own environment families. Importing this package registers their ids."""

from agentrl.registration import register

register("math/arith-v0", "agentrl.envs.math:ArithmeticEnv")
register("search/r1-v0", "agentrl.envs.search.env:SearchEnv", parser="search_r1")
register("search/tools-v0", "agentrl.envs.search.env:SearchEnv", parser="hermes")
register("search/react-v0", "agentrl.envs.search.env:SearchEnv", parser="react")
