"""A long-horizon env whose answer joins facts found many turns apart: for context policies (compaction)."""

from agentrl.envs.recall.env import LedgerEnv

__all__ = ["LedgerEnv"]
