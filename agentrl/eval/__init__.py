"""Evaluation on held-out suites.

- `run`: `run_suite`, a resumable evaluation run directory
- `metrics`: pass@k, maj@k, success with confidence intervals, batch summaries
- `report`, `viewer`: the Markdown / HTML report with plots, and the token viewer
"""
