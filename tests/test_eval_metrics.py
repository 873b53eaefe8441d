"""Evaluation metrics against numbers worked out by hand: pass@k, maj@k, intervals, a whole run summary."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest

from agentrl.eval.metrics import (
    Z95,
    EpisodeInfo,
    diff_interval,
    maj_at_k,
    majority_vote,
    mcnemar_p,
    mean_interval,
    normalize_answer,
    paired_change,
    pass_at_k,
    summarize_run,
    wilson_interval,
)
from agentrl.types import TYPICAL_STOP, Message, Status, ToolCall, Trajectory, Turn

approx = pytest.approx


# ------------------------------------------------------------------------------------------------ pass@k

def test_pass_at_k_by_hand():
    assert pass_at_k(5, 2, 1) == approx(0.4)  # c/n
    assert pass_at_k(5, 2, 2) == approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(10, 3, 4) == approx(1 - 35 / 210)  # 1 - C(7,4)/C(10,4)
    assert pass_at_k(4, 1, 4) == 1.0  # n = k: any correct sample is in the one k-subset
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(8, 8, 3) == 1.0
    assert pass_at_k(8, 0, 3) == 0.0
    assert pass_at_k(3, 2, 2) == 1.0  # n - c < k


def test_pass_at_k_stable_for_large_n():
    # C(1000, 500) overflows a float; the product form does not
    assert pass_at_k(1000, 1, 500) == approx(0.5)
    assert 0.0 < pass_at_k(1000, 1, 1) == approx(0.001)


@pytest.mark.parametrize("n,c,k", [(3, 1, 4), (3, 1, 0), (3, 4, 1), (3, -1, 1)])
def test_pass_at_k_rejects(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


# ------------------------------------------------------------------------------------------------- maj@k

def test_maj_at_k_majority_and_normalization():
    answers = ["Paris", "Lyon", " paris ", "Lyon", "LYON"]
    correct = [True, False, True, False, False]
    assert maj_at_k(answers, correct, 1) == 1.0
    assert maj_at_k(answers, correct, 3) == 1.0  # "paris" 2 votes (strip + casefold) vs "lyon" 1
    assert maj_at_k(answers, correct, 5) == 0.0  # "lyon" 3 votes vs 2


def test_answers_are_compared_by_value_and_spacing():
    assert normalize_answer(" 12 ") == normalize_answer("12.0") == normalize_answer("24/2") == "12"
    assert normalize_answer("Paris.") == normalize_answer("  paris ") == "paris"
    assert normalize_answer(None) is None


def test_majority_vote_ties_are_broken_the_same_whatever_the_order():
    answers = ["8", "7", None, "7.0", " 8", None, None]  # 7 and 8 tie with two votes; None never votes
    for order in itertools.permutations(answers):
        assert majority_vote(list(order)) == "7"  # the smaller in string order
    assert majority_vote([None, None]) is None
    assert majority_vote(["b", "a", "b"]) == "b"


def test_maj_at_k_ties_go_to_the_smaller_answer_whatever_the_order():  # the rule of training's TTRL label too
    assert maj_at_k(["7", "8"], [False, True], 2) == 0.0
    assert maj_at_k(["8", "7"], [True, False], 2) == 0.0
    assert maj_at_k(["8", "7.0", "8", "7"], [True, False, True, False], 4) == 0.0  # 2-2: "7" < "8"


def test_maj_at_k_none_does_not_vote():
    assert maj_at_k([None, None, "x"], [False, False, True], 3) == 1.0  # one vote beats two abstentions
    assert maj_at_k([None, None], [False, False], 2) == 0.0  # no votes: failed
    assert maj_at_k([None, "x"], [False, True], 1) == 0.0  # only the first k count


def test_maj_at_k_custom_normalizer_and_errors():
    assert maj_at_k(["1.0", "1", "2"], [True, True, False], 3, normalize=lambda a: str(float(a))) == 1.0
    assert maj_at_k(["1.0", "2", "1"], [False, False, True], 3, normalize=str) == 1.0  # tie: "1" < "1.0" < "2"
    with pytest.raises(ValueError):
        maj_at_k(["a"], [True], 2)
    with pytest.raises(ValueError):
        maj_at_k(["a", "b"], [True], 1)


# --------------------------------------------------------------------------------------------- intervals

def test_wilson_interval_by_hand():
    # 8/10: p = .8, z²/n = .38416, center = (.8 + .19208)/1.38416, half = z·sqrt(.016 + .009604)/1.38416
    assert wilson_interval(8, 10) == approx((0.490162, 0.943318), abs=1e-6)
    assert wilson_interval(0, 10) == approx((0.0, 0.277533), abs=1e-6)  # not zero-width at 0/n
    assert wilson_interval(10, 10) == approx((0.722467, 1.0), abs=1e-6)
    assert wilson_interval(1, 2, z=1.0) == approx((0.5 - math.sqrt(1 / 12), 0.5 + math.sqrt(1 / 12)))
    with pytest.raises(ValueError):
        wilson_interval(0, 0)
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


def test_mean_interval_by_hand():
    # mean 2.5, s = sqrt(5/3), half = z·s/sqrt(4)
    half = Z95 * math.sqrt(5 / 3) / 2
    assert mean_interval([1, 2, 3, 4]) == approx((2.5 - half, 2.5 + half))
    assert mean_interval([1, 2, 3, 4]) == approx((1.234849, 3.765151), abs=1e-6)
    assert mean_interval([0.5, 0.5, 0.5]) == approx((0.5, 0.5))
    with pytest.raises(ValueError):
        mean_interval([1.0])


def test_diff_interval_by_hand():
    # 8/10 vs 0/10: d = .8; low = .8 - sqrt((.8 - .490162)² + (.277533 - 0)²); high = .8 + sqrt((.943318 - .8)²)
    low = 0.8 - math.sqrt((0.8 - 0.490162) ** 2 + 0.277533 ** 2)
    assert diff_interval(8, 10, 0, 10) == approx((low, 0.943318), abs=1e-5)
    assert low == approx(0.384036, abs=1e-5)
    lo, hi = diff_interval(5, 10, 5, 10)  # equal runs: symmetric around 0
    assert lo == approx(-hi) and hi > 0


def test_paired_change_counts_only_tasks_both_scored():
    before = {"a": True, "b": False, "c": False, "d": True, "e": False}
    after = {"a": True, "b": True, "c": True, "d": False, "f": True}  # e and f were scored once: left out
    assert paired_change(before, after) == (4, 2, 1)


def test_mcnemar_p_by_hand():
    # gained 6, lost 1: P(X <= 1), X ~ Bin(7, 1/2), is (1 + 7) / 128; two-sided, 16 / 128
    assert mcnemar_p(6, 1) == approx(0.125)
    assert mcnemar_p(1, 6) == approx(0.125)
    assert mcnemar_p(5, 0) == approx(2 / 32)
    # 3 and 3: the tail (1 + 6 + 15 + 20) / 64 holds the middle, so doubling passes 1
    assert mcnemar_p(3, 3) == 1.0 and mcnemar_p(0, 0) == 1.0
    # 31 and 6: 2 * sum C(37, i), i <= 6, / 2^37 = 2 * 2,835,200 / 137,438,953,472
    assert mcnemar_p(31, 6) == approx(4.12576e-5, rel=1e-5)


# ------------------------------------------------------------------------------------------- summarize_run

def episode(task: str, entry: str, sample: int, success: bool = False, status: Status = Status.OK,
            reason: str = "", answer: str | None = None, turns: int = 1, hops: int | None = None) -> Trajectory:
    """Prompt of 2 tokens, then per turn 2 sampled tokens and 1 observation token; seconds = 1 + turns;
    tool calls = turns - 1; reward 1 on success."""
    ids, mask, turn_list = [1, 2], [0, 0], []
    for _ in range(turns):
        start = len(ids)
        ids += [3, 4, 5]
        mask += [1, 1, 0]
        turn_list.append(Turn(start, start + 2, start + 3))
    reward = 1.0 if success else 0.0
    metrics = {"success": success, "tool_calls": max(turns - 1, 0), "seconds": 1.0 + turns}
    logs = {"entry": entry, "env": "env/x", "split": entry.split(":")[1], "sample": sample,
            "difficulty": {"hops": hops} if hops is not None else {}}
    return Trajectory(task, tuple(ids), tuple(mask), tuple(0.0 for _ in ids), 2, tuple(turn_list), reward,
                      {"outcome": reward, "format": 1.0}, TYPICAL_STOP[status], reason, answer=answer, metrics=metrics,
                      logs=logs)


S1, S2 = "env/x:s1", "env/x:s2"
ERR, TRUNC, DOWN = Status.ERROR, Status.TRUNCATED, "ConnectionError: down"


def handmade_run() -> list[Trajectory]:
    """Two entries; the same task id in both (they are different tasks); errors and truncations."""
    trajectories = [
        episode("t1", S1, 0, True, answer="Paris", turns=2, hops=2),
        episode("t1", S1, 1, False, answer="Lyon", turns=1, hops=2),
        episode("t1", S1, 2, status=ERR, reason=DOWN, turns=0, hops=2),
        episode("t1", S1, 3, True, answer=" paris ", turns=2, hops=2),
        episode("t2", S1, 0, False, answer="7", turns=1, hops=3),
        episode("t2", S1, 1, False, status=TRUNC, reason="max_turns=4", turns=3, hops=3),
        episode("t2", S1, 2, False, answer="8", turns=1, hops=3),
        episode("t2", S1, 3, True, answer="9", turns=2, hops=3),
        episode("t1", S2, 0, True, answer="a", turns=2, hops=10),
        episode("t1", S2, 1, status=ERR, reason=DOWN, turns=0, hops=10),
        episode("t1", S2, 2, status=ERR, reason="TimeoutError: slow", turns=0, hops=10),
        episode("t1", S2, 3, False, status=TRUNC, reason="max_turns=4", turns=3, hops=10),
    ]
    random.Random(0).shuffle(trajectories)  # the runner writes episodes in completion order
    return trajectories


def test_summarize_run_entry_by_hand():
    s = summarize_run(handmade_run(), ks=[4, 1, 2, 3, 8])
    assert s["ks"] == [1, 2, 3, 4, 8]
    assert list(s["entries"]) == [S1, S2]
    e = s["entries"][S1]
    assert (e["episodes"], e["tasks"], e["samples_per_task"], e["valid"]) == (8, 2, 4, 7)
    # the error is in neither numerator nor denominator: 3 successes of 7 scored episodes
    assert e["success"] == {"rate": approx(3 / 7), "low": approx(wilson_interval(3, 7)[0]),
                            "high": approx(wilson_interval(3, 7)[1]), "successes": 3, "n": 7}
    # rewards [1,0,1 | 0,0,0,1]: mean 3/7, s² = (3·(4/7)² + 4·(3/7)²)/6 = 2/7
    half = Z95 * math.sqrt(2 / 7) / math.sqrt(7)
    assert e["reward"] == {"mean": approx(3 / 7), "low": approx(3 / 7 - half), "high": approx(3 / 7 + half), "n": 7}
    assert e["reward_components"] == {"format": 1.0, "outcome": approx(3 / 7)}
    # t1: n=3 valid, c=2; t2: n=4, c=1. pass@1 = (2/3 + 1/4)/2; pass@2 = (1 + (1 - C(3,2)/C(4,2)))/2;
    # pass@3 = (1 + (1 - C(3,3)/C(4,3)))/2; pass@4: only t2 has 4 valid samples -> 1 - C(3,4)/C(4,4) = 1
    assert e["pass_at_k"] == {"1": {"value": approx(11 / 24), "tasks": 2}, "2": {"value": approx(0.75), "tasks": 2},
                              "3": {"value": approx(0.875), "tasks": 2}, "4": {"value": 1.0, "tasks": 1}}
    # maj over valid samples in sample order. t1: [Paris] -> correct, [Paris, Lyon] (tie -> "lyon" < "paris")
    # -> wrong, [Paris, Lyon, paris] -> correct; t2: [7], [7, None], [7, None, 8], [7, None, 8, 9] -> "7", wrong
    assert e["maj_at_k"] == {"1": {"value": 0.5, "tasks": 2}, "2": {"value": 0.0, "tasks": 2},
                             "3": {"value": 0.5, "tasks": 2}, "4": {"value": 0.0, "tasks": 1}}
    assert e["mean_turns"] == approx(12 / 7)  # valid turns 2,1,2 | 1,3,1,2
    assert e["mean_tool_calls"] == approx(5 / 7)
    assert e["sampled_tokens"] == {"total": 24, "per_episode": 3.0}  # 12 turns x 2, over all 8 episodes
    assert e["seconds"] == {"total": 20.0, "per_episode": 2.5, "max": 4.0}  # the error's 1 s included
    assert e["errors"] == {"count": 1, "rate": 1 / 8, "reasons": [{"reason": DOWN, "count": 1}]}
    assert e["truncated"] == {"count": 1, "rate": 1 / 8, "reasons": [{"reason": "max_turns=4", "count": 1}]}
    assert e["by_difficulty"] == {"hops": {"2": {"rate": approx(2 / 3), "low": approx(wilson_interval(2, 3)[0]),
                                                 "high": approx(wilson_interval(2, 3)[1]), "successes": 2, "n": 3},
                                           "3": {"rate": 0.25, "low": approx(wilson_interval(1, 4)[0]),
                                                 "high": approx(wilson_interval(1, 4)[1]), "successes": 1, "n": 4}}}


def test_summarize_run_small_entry_and_pooled():
    s = summarize_run(handmade_run(), ks=[1, 2, 3, 4, 8])
    e = s["entries"][S2]
    assert (e["episodes"], e["tasks"], e["valid"]) == (4, 1, 2)
    assert e["success"]["rate"] == 0.5
    assert e["pass_at_k"] == {"1": {"value": 0.5, "tasks": 1}, "2": {"value": 1.0, "tasks": 1},
                              "3": {"value": None, "tasks": 0}, "4": {"value": None, "tasks": 0}}
    assert e["maj_at_k"]["2"] == {"value": 1.0, "tasks": 1}  # "a" against an abstention
    assert e["errors"]["count"] == 2 and e["errors"]["rate"] == 0.5
    assert {r["reason"] for r in e["errors"]["reasons"]} == {DOWN, "TimeoutError: slow"}

    a = s["all"]
    assert (a["episodes"], a["tasks"], a["valid"]) == (12, 3, 9)  # (s1,t1), (s1,t2), (s2,t1)
    assert a["success"]["rate"] == approx(4 / 9)
    assert a["pass_at_k"]["1"] == {"value": approx((2 / 3 + 1 / 4 + 1 / 2) / 3), "tasks": 3}
    assert a["pass_at_k"]["2"] == {"value": approx((1 + 0.5 + 1) / 3), "tasks": 3}
    assert a["pass_at_k"]["4"] == {"value": 1.0, "tasks": 1}
    assert "8" not in a["pass_at_k"]  # k above the samples per task is not reported
    assert a["errors"]["count"] == 3 and a["errors"]["rate"] == 0.25
    assert a["errors"]["reasons"][0] == {"reason": DOWN, "count": 2}
    assert a["truncated"] == {"count": 2, "rate": 2 / 12, "reasons": [{"reason": "max_turns=4", "count": 2}]}
    assert list(a["by_difficulty"]["hops"]) == ["2", "3", "10"]  # numeric, not string, order
    assert a["by_difficulty"]["hops"]["10"]["rate"] == 0.5
    json.dumps(s, allow_nan=False)  # plain JSON, no NaN


def test_summarize_run_without_answers_or_valid_episodes():
    only_errors = [episode("t", S1, i, status=ERR, reason=DOWN, turns=0) for i in range(2)]
    e = summarize_run(only_errors, ks=[1])["entries"][S1]
    assert e["success"] == {"rate": None, "low": None, "high": None, "successes": 0, "n": 0}
    assert e["reward"]["mean"] is None and e["mean_turns"] is None
    assert e["pass_at_k"] == {"1": {"value": None, "tasks": 0}}
    assert e["maj_at_k"] == {}  # no answers anywhere: maj@k is not reported
    assert e["errors"]["rate"] == 1.0


def test_episode_info_requires_eval_fields_and_counts_tool_calls():
    t = episode("t", S1, 0)
    with pytest.raises(ValueError, match="sample"):
        EpisodeInfo.of(Trajectory("t", (), (), (), 0, (), 0.0, metrics={"success": True}, logs={"entry": S1}))
    call = ToolCall("search", {"query": "x"})
    messages = (Message("user", "q"), Message("assistant", "", (call, call)), Message("tool", "obs", name="search"))
    metrics = {k: v for k, v in t.metrics.items() if k != "tool_calls"}
    bare = Trajectory("t", (), (), (), 0, (), 0.0, messages=messages, metrics=metrics, logs=t.logs)
    assert EpisodeInfo.of(bare).tool_calls == 2
