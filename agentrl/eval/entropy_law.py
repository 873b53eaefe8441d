"""The entropy-performance law (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
Language Models"): without entropy regularization, held-out performance follows

    R = -a * exp(H) + b

in the policy's entropy H, as training trades entropy for performance. The law is linear in exp(H), so it is fit
by least squares, and its ceiling -a + b (the performance at H = 0, once the policy is deterministic) can be
predicted before the run ends. The ceiling's interval is the fitted line's 95% confidence interval at exp(H) = 1:
an extrapolation, wide while the entropy has fallen little.

A training run gives the points: each held-out evaluation during training (`[eval] every`) with the entropy of its
step's update (`entropy`, the mean over the sampled tokens), the one before RL with the first step's, and the final
one with the last step's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from scipy import stats

MIN_POINTS = 3  # two parameters and at least one degree of freedom for the interval


@dataclass(frozen=True)
class EntropyLaw:
    """A fit of R = -a·exp(H) + b: its parameters, the ceiling -a + b with its 95% interval, and the fit's R²."""

    a: float
    b: float
    ceiling: float
    low: float
    high: float
    r2: float
    n: int

    def predict(self, entropy: float) -> float:
        """The performance the law gives at `entropy`."""
        return self.b - self.a * math.exp(entropy)


def fit_entropy_law(entropy: Sequence[float], performance: Sequence[float], level: float = 0.95) -> EntropyLaw:
    """Least squares of `performance` on exp(`entropy`); ValueError with fewer than 3 points or one entropy."""
    if len(entropy) != len(performance) or len(entropy) < MIN_POINTS:
        raise ValueError(f"the entropy law needs at least {MIN_POINTS} (entropy, performance) points, "
                         f"got {min(len(entropy), len(performance))}: evaluate more often ([eval] every)")
    x, y = np.exp(np.asarray(entropy, dtype=float)), np.asarray(performance, dtype=float)
    sxx = float(((x - x.mean()) ** 2).sum())
    if sxx == 0:
        raise ValueError("the entropy law needs points at more than one entropy")
    slope = float(((x - x.mean()) * (y - y.mean())).sum()) / sxx
    intercept = float(y.mean()) - slope * float(x.mean())
    residuals = y - (intercept + slope * x)
    n = len(x)
    s = math.sqrt(float((residuals ** 2).sum()) / (n - 2))
    se = s * math.sqrt(1 / n + (1 - float(x.mean())) ** 2 / sxx)  # of the line's value at x = exp(0) = 1
    half = float(stats.t.ppf(0.5 + level / 2, n - 2)) * se
    ceiling = intercept + slope
    syy = float(((y - y.mean()) ** 2).sum())
    return EntropyLaw(a=-slope, b=intercept, ceiling=ceiling, low=ceiling - half, high=ceiling + half,
                      r2=1 - float((residuals ** 2).sum()) / syy if syy > 0 else math.nan, n=n)


def law_points(rows: Sequence[dict[str, Any]], summary: dict[str, Any]) -> list[tuple[int, float, float]]:
    """(step, entropy, held-out success) of a training run: the evaluation before RL as step 0, with the first
    step's entropy (measured on the starting policy's own samples, before most of that step's updates); every step
    with a held-out evaluation; and the final evaluation (`summary["after"]`) with the last step's entropy."""
    logged = [r for r in rows if "entropy" in r]
    points = [(r["step"], r["entropy"], r["heldout"]["success"]) for r in logged if "success" in r.get("heldout", {})]
    if logged and logged[0]["step"] == 1 and "success" in summary.get("before", {}):
        points.insert(0, (0, logged[0]["entropy"], summary["before"]["success"]))
    if logged and "success" in summary.get("after", {}) and all(p[0] != logged[-1]["step"] for p in points):
        points.append((logged[-1]["step"], logged[-1]["entropy"], summary["after"]["success"]))
    return points


def early_predictions(points: Sequence[tuple[int, float, float]]) -> list[tuple[int, EntropyLaw]]:
    """The law fit on the points up to each step (from the third on): how the predicted ceiling settles."""
    return [(points[k - 1][0], fit_entropy_law([p[1] for p in points[:k]], [p[2] for p in points[:k]]))
            for k in range(MIN_POINTS, len(points) + 1)]


def settled_step(predictions: Sequence[tuple[int, EntropyLaw]], final: float, tolerance: float = 0.05) -> int | None:
    """The first step from which every prediction of the ceiling is within `tolerance` of `final` (None: never)."""
    step = None
    for s, law in predictions:
        if abs(law.ceiling - final) > tolerance:
            step = None
        elif step is None:
            step = s
    return step


def entropy_law_panel(rows: Sequence[dict[str, Any]], summary: dict[str, Any]) -> dict[str, Any] | None:
    """What a report shows of a training run's entropy law: its points, the fit on all of them, the ceiling
    predicted at each step, the final held-out success and the step from which the prediction stays within 5
    points of it. None when the run has fewer than 3 points (or one entropy)."""
    points = law_points(rows, summary)
    try:
        law = fit_entropy_law([p[1] for p in points], [p[2] for p in points])
    except ValueError:
        return None
    predictions = early_predictions(points)
    final = summary.get("after", {}).get("success")
    return {"points": points, "law": law, "predictions": predictions, "final": final,
            "settled_step": settled_step(predictions, final) if final is not None else None}
