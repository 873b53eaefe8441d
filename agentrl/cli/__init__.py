"""The `agentrl` command (`main`), its `serve` commands, and the typed configs of its jobs (`jobs`)."""
