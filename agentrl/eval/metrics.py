"""Evaluation metrics over a run's trajectories: pass@k, maj@k, confidence intervals, per-entry summaries.

Everything here is a pure function of its arguments. `summarize_run` reads the eval runner's per-episode
`metrics` and `logs` (entry, sample, success, tool_calls, seconds, difficulty) and returns plain JSON-ready data.

Project rule: errors are never scored as failures. An `error` episode is left out of every success,
reward, pass@k and maj@k denominator and counted separately, with its reason.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from agentrl.types import Status, Trajectory

Z95 = 1.959963984540054  # two-sided 95% normal quantile
TOP_REASONS = 5  # how many of the most common error / truncation reasons a summary keeps


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of Chen et al. 2021 from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms the (huge) binomials."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}: pass@k needs at least k samples")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def normalize_answer(answer: str | None) -> str | None:
    """The form answers are compared (and voted) in: case and spacing folded, numbers by value, so
    " 12 ", "12.0" and "24/2" are one answer. None (no final answer) stays None and never votes."""
    if answer is None:
        return None
    text = re.sub(r"\s+", " ", answer.strip().casefold()).rstrip(".")
    try:
        return str(Fraction(text.replace(" ", "")))
    except (ValueError, ZeroDivisionError):
        return text


def majority_vote(answers: Sequence[str | None], normalize: Callable[[str], str] = normalize_answer) -> str | None:
    """The most common normalized answer; a tie goes to the smallest in string order, so the winner does not
    depend on the order in which samples finished. None answers do not vote; None when nobody answered. The
    one vote rule of training (TTRL's majority label) and evaluation (maj@k)."""
    counts = Counter(normalize(a) for a in answers if a is not None)
    if not counts:
        return None
    top = max(counts.values())
    return min(a for a, c in counts.items() if c == top)


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int,
             normalize: Callable[[str], str] = normalize_answer) -> float:
    """Majority vote (`majority_vote`) over the first k samples: 1.0 if the winning answer was correct.

    With no votes at all the task is failed. The winning answer's correctness is that of its first sample."""
    if len(answers) != len(correct):
        raise ValueError(f"answers and correct differ in length: {len(answers)} != {len(correct)}")
    if not 1 <= k <= len(answers):
        raise ValueError(f"need 1 <= k <= {len(answers)} (the number of samples), got k={k}")
    winner = majority_vote(answers[:k], normalize)
    if winner is None:
        return 0.0
    first = next(i for i in range(k) if answers[i] is not None and normalize(answers[i]) == winner)
    return 1.0 if correct[first] else 0.0


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95% by default). Unlike p ± z·se it stays inside
    [0, 1] and is not zero-width at 0/n or n/n, which matters for the small n of agent evals."""
    if n <= 0:
        raise ValueError("wilson_interval needs n >= 1")
    if not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got {successes}/{n}")
    p, z2 = successes / n, z * z
    denom = 1 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def mean_interval(values: Sequence[float], z: float = Z95) -> tuple[float, float]:
    """Normal-approximation interval of a mean: mean ± z · s / sqrt(n), s the sample standard deviation."""
    n = len(values)
    if n < 2:
        raise ValueError(f"mean_interval needs at least 2 values, got {n}")
    mean = sum(values) / n
    s = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = z * s / math.sqrt(n)
    return mean - half, mean + half


def diff_interval(s1: int, n1: int, s2: int, n2: int, z: float = Z95) -> tuple[float, float]:
    """Interval of p1 - p2 for two independent proportions from their Wilson intervals (Newcombe 1998,
    method 10): the run-vs-run comparison of a report."""
    p1, p2 = s1 / n1, s2 / n2
    l1, u1 = wilson_interval(s1, n1, z)
    l2, u2 = wilson_interval(s2, n2, z)
    d = p1 - p2
    return d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)


def paired_change(before: Mapping[Any, bool], after: Mapping[Any, bool]) -> tuple[int, int, int]:
    """(tasks scored in both, gained: failed before and solved after, lost: the reverse). On the same tasks,
    the discordant ones carry all the evidence of a change (McNemar); the rest is shared noise."""
    common = before.keys() & after.keys()
    return (len(common), sum(1 for k in common if after[k] and not before[k]),
            sum(1 for k in common if before[k] and not after[k]))


def mcnemar_p(gained: int, lost: int) -> float:
    """Exact two-sided McNemar p-value: the chance, were before and after equally good, that the gained + lost
    discordant tasks split at least this unevenly (each way with probability 1/2)."""
    m = gained + lost
    tail = sum(math.comb(m, i) for i in range(min(gained, lost) + 1)) / 2 ** m
    return min(1.0, 2 * tail)


# ------------------------------------------------------------------------------------------ run summaries

@dataclass(frozen=True)
class EpisodeInfo:
    """The eval runner's per-episode fields (in `Trajectory.metrics` and `logs`), read and checked in one place."""

    entry: str
    sample: int
    success: bool
    answer: str | None
    tool_calls: int
    seconds: float | None
    difficulty: Mapping[str, Any]

    @classmethod
    def of(cls, t: Trajectory) -> EpisodeInfo:
        """The eval fields of `t`; raises `ValueError` when `entry`, `sample` or `success` is missing
        (not a trajectory of an eval run)."""
        wanted = (("entry", t.logs), ("sample", t.logs), ("success", t.metrics))
        missing = [key for key, held in wanted if key not in held]
        if missing:
            raise ValueError(f"trajectory of task {t.task_id!r} has no {missing}: summarize_run needs the "
                             "trajectories of an eval run (`agentrl eval` writes entry, sample and success)")
        # tool_calls falls back to the calls the messages hold, which is what the runner counts
        calls = t.metrics.get("tool_calls", sum(len(m.tool_calls) for m in t.messages if m.role == "assistant"))
        return cls(t.logs["entry"], int(t.logs["sample"]), bool(t.metrics["success"]), t.answer,
                   int(calls), t.metrics.get("seconds"), t.logs.get("difficulty") or {})


Episode = tuple[Trajectory, EpisodeInfo]


def summarize_run(trajectories: Sequence[Trajectory], ks: Sequence[int],
                  normalize: Callable[[str], str] = normalize_answer) -> dict[str, Any]:
    """Metrics per entry (sorted by name) and over all entries pooled (`"all"`).

    A task is (entry, task_id); its samples are its episodes. pass@k and maj@k are computed per task from
    its non-error samples (errors leave both n and c) and averaged over tasks; a task with fewer than k
    non-error samples is left out of that k, and `tasks` says how many counted. A k larger than the
    number of samples per task is not reported. Success, reward, turns and tool calls are over non-error
    episodes; tokens and wall time (costs) over all episodes. Undefined numbers are None."""
    episodes = [(t, EpisodeInfo.of(t)) for t in trajectories]
    by_entry: dict[str, list[Episode]] = defaultdict(list)
    for ep in episodes:
        by_entry[ep[1].entry].append(ep)
    ks = sorted(set(ks))
    return {
        "ks": ks,
        "entries": {name: summarize_episodes(by_entry[name], ks, normalize) for name in sorted(by_entry)},
        "all": summarize_episodes(episodes, ks, normalize),
    }


def summarize_episodes(episodes: Sequence[Episode], ks: Sequence[int],
                       normalize: Callable[[str], str] = normalize_answer) -> dict[str, Any]:
    """The metrics of one entry (or of all entries pooled); see `summarize_run`."""
    valid = [(t, i) for t, i in episodes if t.status is not Status.ERROR]
    n, n_valid = len(episodes), len(valid)
    tasks: dict[tuple[str, str], list[Episode]] = defaultdict(list)
    for t, i in episodes:
        tasks[(i.entry, t.task_id)].append((t, i))
    samples = max((len(eps) for eps in tasks.values()), default=0)
    components: dict[str, list[float]] = defaultdict(list)
    for t, _ in valid:
        for name, value in t.reward_components.items():
            components[name].append(value)
    tokens = sum(t.metrics.get("episode_sampled_tokens", t.num_sampled) for t, _ in episodes)  # every segment's
    seconds = [i.seconds for _, i in episodes if i.seconds is not None]
    out: dict[str, Any] = {
        "episodes": n,
        "tasks": len(tasks),
        "samples_per_task": samples,
        "valid": n_valid,
        "success": proportion(sum(i.success for _, i in valid), n_valid),
        "reward": mean_summary([t.reward for t, _ in valid]),
        "reward_components": {k: sum(v) / len(v) for k, v in sorted(components.items())},
        "pass_at_k": {},
        "maj_at_k": {},
        "mean_turns": _mean([t.metrics.get("episode_turns", len(t.turns)) for t, _ in valid]),
        "mean_tool_calls": _mean([i.tool_calls for _, i in valid]),
        "sampled_tokens": {"total": tokens, "per_episode": tokens / n if n else None},
        "seconds": {"total": sum(seconds) if seconds else None, "per_episode": _mean(seconds),
                    "max": max(seconds, default=None)},
        "errors": _status_count(episodes, Status.ERROR),
        "truncated": _status_count(episodes, Status.TRUNCATED),
        "by_difficulty": by_difficulty(valid),
        **({"by_segments": by_segments(valid)} if any("segments" in t.metrics for t, _ in valid) else {}),
    }
    per_task = [sorted((ep for ep in eps if ep[0].status is not Status.ERROR), key=lambda ep: ep[1].sample)
                for eps in tasks.values()]
    has_answers = any(i.answer is not None for _, i in valid)
    for k in (k for k in ks if k <= samples):
        counted = [eps for eps in per_task if len(eps) >= k]
        out["pass_at_k"][str(k)] = {
            "value": _mean([pass_at_k(len(eps), sum(i.success for _, i in eps), k) for eps in counted]),
            "tasks": len(counted)}
        if has_answers:
            out["maj_at_k"][str(k)] = {
                "value": _mean([maj_at_k([i.answer for _, i in eps], [i.success for _, i in eps], k, normalize)
                                for eps in counted]),
                "tasks": len(counted)}
    return out


def proportion(successes: int, n: int) -> dict[str, Any]:
    """A rate with its Wilson 95% interval; rate and bounds are None when n is 0."""
    low, high = wilson_interval(successes, n) if n else (None, None)
    return {"rate": successes / n if n else None, "low": low, "high": high, "successes": successes, "n": n}


def mean_summary(values: Sequence[float]) -> dict[str, Any]:
    """A mean with its 95% interval; the interval is None below 2 values, the mean below 1."""
    low, high = mean_interval(values) if len(values) >= 2 else (None, None)
    return {"mean": _mean(values), "low": low, "high": high, "n": len(values)}


def by_difficulty(valid: Sequence[Episode]) -> dict[str, dict[str, dict[str, Any]]]:
    """Success per value of each difficulty key (e.g. {"hops": {"2": {...}, "3": {...}}}), values in
    numeric order where they are numbers. Keys are strings so the result is JSON as it stands."""
    groups: dict[str, dict[Any, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for _, i in valid:
        for key, value in i.difficulty.items():
            groups[key][value].append(i.success)
    return {key: {str(value): proportion(sum(ok), len(ok)) for value, ok in sorted(values.items(), key=_order)}
            for key, values in sorted(groups.items())}


def by_segments(valid: Sequence[Episode]) -> dict[str, dict[str, Any]]:
    """Success by the number of segments an episode took (1: it fit its context window; a context policy's)."""
    groups = _by(valid, lambda episode: episode[0].metrics.get("segments", 1))
    return {str(n): proportion(sum(i.success for _, i in eps), len(eps)) for n, eps in sorted(groups.items())}


def episodes_of(trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """One trajectory per episode: of the segments of one (`Trajectory.session`), the last, whose metrics hold the
    episode's totals; every other trajectory as it is."""
    last: dict[str, Trajectory] = {}
    for t in trajectories:
        if t.session is not None and (t.session not in last or
                                      t.logs.get("segment", 0) > last[t.session].logs.get("segment", 0)):
            last[t.session] = t
    return [t for t in trajectories if t.session is None or last[t.session] is t]


def _order(item: tuple[Any, Any]) -> tuple[int, float, str]:
    value = item[0]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return 0, float(value), ""
    return 1, 0.0, str(value)


def _status_count(episodes: Sequence[Episode], status: Status) -> dict[str, Any]:
    hits = [t for t, _ in episodes if t.status is status]
    reasons = Counter(t.reason or "(no reason)" for t in hits).most_common(TOP_REASONS)
    return {"count": len(hits), "rate": len(hits) / len(episodes) if episodes else None,
            "reasons": [{"reason": r, "count": c} for r, c in reasons]}


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def is_success(t: Trajectory, max_reward: float) -> bool:
    """Outcome reward 1, or for envs without an outcome component, the env's maximum reward."""
    if "outcome" in t.reward_components:
        return t.reward_components["outcome"] >= 1.0
    return t.reward >= max_reward - 1e-9


def summarize(trajectories: Sequence[Trajectory], max_reward: float | None = None,
              seconds: float | None = None) -> dict[str, Any]:
    """Counts and means for a batch, per episode (the segments of one counted once, `episodes_of`; their tokens and
    turns all counted). Rewards and success are over non-error episodes only; errors and truncations are counted
    with their most common reasons."""
    segments, trajectories = trajectories, episodes_of(trajectories)
    valid = [t for t in trajectories if t.status is not Status.ERROR]
    n, n_valid, turns = len(trajectories), max(len(valid), 1), sum(len(t.turns) for t in segments)
    sampled = sum(t.num_sampled for t in segments)
    components: Counter[str] = Counter()
    for t in valid:
        components.update(t.reward_components)
    out: dict[str, Any] = {
        "episodes": n,
        "status": dict(Counter(t.status.value for t in trajectories)),
        "stops": dict(Counter(t.stop.value for t in trajectories if t.stop)),
        "mean_reward": sum(t.reward for t in valid) / n_valid if valid else float("nan"),
        "reward_components": {k: v / n_valid for k, v in components.items()},
        "mean_turns": turns / n if n else 0.0,
        "sampled_tokens": sampled,
        # the learning dynamics Search-R1 draws: tool calls (searches) and response length per episode, and the
        # share of turns whose action the env took (not answered with a correction)
        "mean_tool_calls": sum(t.metrics.get("tool_calls", 0) for t in trajectories) / n if n else 0.0,
        "mean_sampled_tokens": sampled / n if n else 0.0,
        "valid_action_rate": 1 - sum(t.metrics.get("invalid_actions", 0) for t in trajectories) / max(turns, 1),
        "reasons": dict(Counter(t.reason for t in trajectories if t.reason).most_common(5)),
    }
    if max_reward is not None:
        out["success"] = sum(is_success(t, max_reward) for t in valid) / n_valid if valid else float("nan")
    if len(segments) > n:  # a context policy's (or agent sessions'): how often, how long the summaries, what came of it
        summaries = sum(t.metrics.get("summaries", 0) for t in trajectories)
        out["segments_per_episode"] = len(segments) / n
        out["mean_summary_tokens"] = sum(t.metrics.get("summary_tokens", 0) for t in trajectories) / summaries \
            if summaries else 0.0
        if max_reward is not None:
            out["success_by_segments"] = {str(k): sum(is_success(t, max_reward) for t in ts) / len(ts) for k, ts in
                                          sorted(_by(valid, lambda t: t.metrics.get("segments", 1)).items())}
    if seconds:
        out["seconds"] = round(seconds, 2)
        out["episodes_per_s"] = round(n / seconds, 3)
    return out


def _by(items: Sequence[Any], key: Callable[[Any], Any]) -> dict[Any, list[Any]]:
    groups: dict[Any, list[Any]] = defaultdict(list)
    for item in items:
        groups[key(item)].append(item)
    return groups
