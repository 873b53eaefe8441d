"""agentrl's own environment families. Importing this package registers their ids."""

from agentrl.env.registry import register
from agentrl.env.suites import Suite, SuiteEntry, register_suite
from agentrl.envs.web.miniwob import HELDOUT_TYPES as MINIWOB_HELDOUT_TYPES, TRAIN_TYPES as MINIWOB_TRAIN_TYPES

register("math/arith-v0", "agentrl.envs.math:ArithmeticEnv")
register("search/r1-v0", "agentrl.envs.search.env:SearchEnv", parser="search_r1")
register("search/tools-v0", "agentrl.envs.search.env:SearchEnv", parser="hermes")
register("search/react-v0", "agentrl.envs.search.env:SearchEnv", parser="react")
register("code/humaneval-v0", "agentrl.envs.code:CodeEnv", source="humaneval")
register("code/generated-v0", "agentrl.envs.code:CodeEnv", source="generated")
register("swe/generated-v0", "agentrl.envs.swe:SWEEnv")  # `agentrl swe generate` first
register("swe/instances-v0", "agentrl.envs.swe:SWEEnv")  # instances=PATH: SWE-bench style JSONL with images
register("harbor/tasks-v0", "agentrl.envs.harbor:HarborEnv")  # tasks=DIR: Harbor task folders (Docker)
register("web/miniwob-v0", "agentrl.envs.web.miniwob:MiniWoBEnv")  # splits train / heldout_seeds / heldout_types
for _name in (*MINIWOB_TRAIN_TYPES, *MINIWOB_HELDOUT_TYPES):  # the tasks with scripted solvers; others: tasks=[name]
    register(f"web/miniwob-{_name}-v0", "agentrl.envs.web.miniwob:MiniWoBEnv", tasks=[_name])
register("web/shop-v0", "agentrl.envs.web.shop.env:ShopEnv")
register("mcp/tools-v0", "agentrl.envs.mcp:McpToolsEnv")  # tasks=PATH (JSON Lines), servers=[{name, command|url}]
register("recall/ledger-v0", "agentrl.envs.recall:LedgerEnv")  # splits train / heldout / heldout_long
register("recall/ledger-many-v0", "agentrl.envs.recall:LedgerEnv", every_page=True)  # a code on every page
register("memory/reflexion-v0", "agentrl.env.memory:ReflexionEnv")  # env=ID, env_kwargs={...}: notes across attempts

# Other libraries' envs (agentrl/env/adapters; docs/adapters.md), with a solver each so that they check.
register("gymnasium/FrozenLake-v1", "agentrl.env.adapters.gymnasium_env:GymnasiumEnv", gym_id="FrozenLake-v1",
         render_mode="ansi", is_slippery=False, solver="agentrl.env.adapters.gymnasium_env:frozen_lake_solver",
         instructions="Walk from S to the goal G on the frozen lake without stepping into a hole H. "
                      "Actions: 0 left, 1 down, 2 right, 3 up.")
register("textarena/GuessTheNumber-v0", "agentrl.env.adapters.textarena_env:TextArenaEnv", game="GuessTheNumber-v0")
register("skyrl/gsm8k-v0", "agentrl.envs.math.adapted:ArithmeticSkyRLEnv", env_class="gsm8k")
register("skyrl/gsm8k_multi_turn-v0", "agentrl.envs.math.adapted:ArithmeticSkyRLEnv", env_class="gsm8k_multi_turn")
register("verifiers/arith-tools-v0", "agentrl.env.adapters.verifiers_env:VerifiersEnv",
         environment="agentrl.envs.math.adapted", env_args={"kind": "arith_tools"})
register("verifiers/guess-v0", "agentrl.env.adapters.verifiers_env:VerifiersEnv",
         environment="agentrl.envs.math.adapted", env_args={"kind": "guess"})
register("verifiers/env-v0", "agentrl.env.adapters.verifiers_env:VerifiersEnv")  # environment="NAME" required
register("verifiers/v1-v0", "agentrl.env.adapters.verifiers_v1:VerifiersV1Env")  # taskset={"id": ...} required
register("nemo_gym/env-v0", "agentrl.env.adapters.nemo_gym_env:NemoGymEnv")  # episodes: nemo_gym_env:solve
register("openenv/remote-v0", "agentrl.env.adapters.openenv_env:OpenEnvEnv")  # url="http://host:port" required

register_suite(Suite("math/heldout", (SuiteEntry("math/arith-v0", "heldout", 200),),
                     description="Arithmetic expression and word problems the training split never holds."))
register_suite(Suite("search/heldout", tuple(
    SuiteEntry("search/r1-v0", split, 100)
    for split in ("unseen_entities", "unseen_compositions", "more_hops", "paraphrase")),
    description="Search-R1 agents on the generated world's four held-out suites."))
register_suite(Suite("code/heldout", (SuiteEntry("code/humaneval-v0", "heldout", 33),
                                      SuiteEntry("code/generated-v0", "heldout", 100)),
                     description="HumanEval's held-out fifth, and generated functions of templates training never shows "
                                 "(Docker sandboxes)."))
