"""The entropy-performance law R = -a·exp(H) + b: the fit on synthetic runs with known a and b, its interval's
coverage, and the points a training run gives (the report's panel: tests/test_report.py)."""

import math
import random

import pytest

from agentrl.eval.entropy_law import (early_predictions, entropy_law_panel, fit_entropy_law, law_points,
                                      settled_step)

A, B = 0.3, 1.1  # ceiling -A + B = 0.8


def test_an_exact_law_is_recovered():
    entropy = [1.2, 1.0, 0.8, 0.6, 0.5]
    law = fit_entropy_law(entropy, [B - A * math.exp(h) for h in entropy])
    assert (law.a, law.b, law.ceiling) == pytest.approx((A, B, B - A))
    assert law.high - law.low == pytest.approx(0, abs=1e-9) and law.r2 == pytest.approx(1)
    assert law.predict(0.7) == pytest.approx(B - A * math.exp(0.7))


def test_the_ceilings_interval_covers_the_true_one_95_percent_of_the_time():
    rng, hits, trials = random.Random(0), 0, 400
    entropy = [1.3 - 0.1 * i for i in range(8)]  # entropy falling over training, as it does without a bonus
    for _ in range(trials):
        law = fit_entropy_law(entropy, [B - A * math.exp(h) + rng.gauss(0, 0.02) for h in entropy])
        hits += law.low <= B - A <= law.high
    assert 0.92 <= hits / trials <= 0.98  # binomial sd at 0.95 over 400: 0.011


def test_too_few_points_or_one_entropy_are_errors():
    with pytest.raises(ValueError, match="at least 3"):
        fit_entropy_law([1.0, 0.9], [0.2, 0.3])
    with pytest.raises(ValueError, match="more than one entropy"):
        fit_entropy_law([1.0] * 3, [0.2, 0.3, 0.4])


def run_rows(steps=range(1, 21), every=4):
    """A run whose held-out success follows the law as its entropy falls; held-out every `every` steps."""
    rows = []
    for s in steps:
        h = 1.4 * math.exp(-s / 10)
        row = {"step": s, "entropy": h, "success": 0.1}
        if s % every == 0 and s < steps[-1]:
            row["heldout"] = {"success": B - A * math.exp(h) + (0.03 if s == 4 else 0.0)}
        rows.append(row)
    return rows


def test_points_predictions_and_when_they_settle():
    rows = run_rows()
    final = B - A * math.exp(rows[-1]["entropy"])
    points = law_points(rows, {"after": {"success": final}})
    assert [p[0] for p in points] == [4, 8, 12, 16, 20]  # the final evaluation pairs with the last step
    assert points[-1] == (20, rows[-1]["entropy"], final)
    with_before = law_points(rows, {"before": {"success": 0.5}, "after": {"success": final}})
    assert with_before == [(0, rows[0]["entropy"], 0.5), *points]  # the starting policy: the first step's entropy
    predictions = early_predictions(points)
    assert [s for s, _ in predictions] == [12, 16, 20]
    assert predictions[-1][1].ceiling == pytest.approx(fit_entropy_law([p[1] for p in points],
                                                                       [p[2] for p in points]).ceiling)
    # the first fits: the noisy evaluation at step 4 pulls the ceiling down; all points: close to the true 0.8
    assert predictions[0][1].ceiling < predictions[-1][1].ceiling == pytest.approx(B - A, abs=0.02)
    assert entropy_law_panel(rows[:9], {}) is None  # two held-out points: no fit


def test_a_prediction_settles_when_it_stays_within_tolerance():
    def law(ceiling):
        return fit_entropy_law([0.3, 0.2, 0.1], [ceiling - 0.1 * (math.exp(h) - 1) for h in (0.3, 0.2, 0.1)])

    assert settled_step([(3, law(0.6)), (6, law(0.76)), (9, law(0.74)), (12, law(0.78))], 0.75) == 6
    assert settled_step([(3, law(0.76)), (6, law(0.6)), (9, law(0.74))], 0.75) == 9  # left, then came back
    assert settled_step([(3, law(0.76)), (6, law(0.6))], 0.75) is None
