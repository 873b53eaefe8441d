"""Other libraries' environments as agentrl envs (in), and agentrl envs for other libraries (out).

In: `gymnasium_env.GymnasiumEnv` (any Gymnasium env, text or discrete), `textarena_env.TextArenaEnv`,
`skyrl_env.SkyRLEnv`, `verifiers_env.VerifiersEnv` (verifiers 0.1 envs), `openenv_env.OpenEnvEnv` (any OpenEnv
server). Out: `openenv_server` (`agentrl serve env ID`), `trl_env.trl_environment` (TRL's `environment_factory`).
What each supports: docs/adapters.md.
"""
