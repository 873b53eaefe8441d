"""A results table of several evaluations of the same tasks (Search-R1's baselines table): per suite the success
rate with its 95% interval, the mean over the suites, and the paired change against one reference row on the
tasks both scored (gained / lost, McNemar's exact p). Pure functions of per-task outcomes; `agentrl baselines`
reads them from eval run directories.
"""

from __future__ import annotations

from collections.abc import Mapping

from agentrl.eval.metrics import mcnemar_p, paired_change, wilson_interval

Outcomes = Mapping[tuple[str, str], bool]  # (suite, task id) -> success; error episodes left out


def suites_of(rows: Mapping[str, Outcomes]) -> list[str]:
    """The suites of the rows, in order of first appearance."""
    return list(dict.fromkeys(suite for outcomes in rows.values() for suite, _ in outcomes))


def suite_results(outcomes: Outcomes, suite: str) -> list[bool]:
    """Each of one suite's episodes: whether it succeeded."""
    return [ok for (s, _), ok in outcomes.items() if s == suite]


def rate_cell(outcomes: Outcomes, suite: str) -> str:
    """`0.235 [0.18, 0.30] (n=200)` for one suite's tasks, `-` when the row has none."""
    results = suite_results(outcomes, suite)
    if not results:
        return "-"
    lo, hi = wilson_interval(sum(results), len(results))
    return f"{sum(results) / len(results):.3f} [{lo:.2f}, {hi:.2f}] (n={len(results)})"


def mean_over_suites(outcomes: Outcomes, suites: list[str]) -> float | None:
    """The unweighted mean of the suites' success rates (None unless the row has every suite)."""
    per_suite = [suite_results(outcomes, suite) for suite in suites]
    if not all(per_suite):
        return None
    return sum(sum(r) / len(r) for r in per_suite) / len(per_suite)


def paired_cell(outcomes: Outcomes, reference: Outcomes) -> str:
    """`+31 / -6 (p=2.3e-05) on 800` against the reference, on the tasks both scored."""
    common, gained, lost = paired_change(reference, outcomes)
    return f"+{gained} / -{lost} (p={mcnemar_p(gained, lost):.2g}) on {common}"


def results_table(rows: Mapping[str, Outcomes], against: str) -> str:
    """The Markdown table: one row per evaluation, one column per suite, the mean over suites, and the paired change
    against the row `against` (its own cell `reference`)."""
    if against not in rows:
        raise KeyError(f"--against {against!r} names no row; the rows are {list(rows)}")
    suites = suites_of(rows)
    lines = ["| | " + " | ".join(suites) + " | mean over suites | paired vs " + against + " |",
             "| --- | " + " | ".join("---" for _ in suites) + " | --: | --- |"]
    for name, outcomes in rows.items():
        mean = mean_over_suites(outcomes, suites)
        paired = "reference" if name == against else paired_cell(outcomes, rows[against])
        lines.append(f"| {name} | " + " | ".join(rate_cell(outcomes, s) for s in suites) +
                     f" | {'-' if mean is None else f'{mean:.3f}'} | {paired} |")
    return "\n".join(lines) + "\n"
