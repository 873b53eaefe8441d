"""The environment API and everything that finds or checks an env.

- `api`: `TextEnv` / `ToolEnv`, the Gymnasium contract for multi-turn text envs
- `registry`: `register`, `make`, `check` by versioned id (plugins through the `agentrl.envs` entry points)
- `suites`: named held-out suites, lists of (env id, split)
- `conformance`: the checks every registered env passes
- `adapters/`: other libraries' envs as agentrl envs, and ours for theirs
"""
