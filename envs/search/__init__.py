"""Search environments: Search-R1 and ReAct agents over a real BM25 index (issue #5)."""
