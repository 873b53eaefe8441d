"""Reward sources from the research, composable with any env: the training reward is a weighted sum

    R_i = sum_k  weight_k * source_k(trajectory i, its group)

over the sources named in `RewardConfig.terms`. The env's own reward stays on the trajectory (and in the
rollout metrics, so `success` is always the true outcome); only the advantages see `R`.

Sources (in [0, 1] but for the two of the policy's confidence, which are in nats):
- `env`: the env's reward as is (the default, `{"env": 1.0}`).
- `outcome`, `process`: one reward component of the env (the math env scores both: the final answer,
  and the fraction of written equations that are true), to compare outcome and process supervision.
- `majority_vote`: 1 if the trajectory's final answer is the group's most common answer, else 0: the
  pseudo-label of test-time RL (TTRL, Zuo et al. 2025), which needs no gold answer.
- `format`: 1 if the episode ended with a final answer at all (format-only control).
- `random`: a fair coin per trajectory, seeded by (seed, task, sample): the spurious-reward control.
- `inverted`: 1 - outcome: rewards wrong answers (a control that should make success fall).
- `length`: sampled tokens / `length_norm`; give it a negative weight for a length penalty.
- `judge`: a judge model's score (`trainers/rewards/judge.py`, settings in `RewardConfig.judge`). It may be missing for a
  trajectory (the judge never gave a usable reply): that trajectory then has no training reward, is left out of its
  group's baseline and is not trained on (`rewarded`).
- `rent`, `self_certainty`: the policy's confidence in its response, without labels: minus its mean token entropy
  (RENT), and its mean KL from uniform (self-certainty) (`trainers/rewards/confidence.py`). Scored by the trainer's model
  at training time (`score_confidence`); `keep` cannot see them, and they vary whenever a group's responses do.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from pydantic import with_config

from agentrl.config import STRICT
from agentrl.eval.metrics import majority_vote, normalize_answer
from agentrl.trainers.rewards.confidence import CONFIDENCE_SOURCES, confidence, confidence_metrics
from agentrl.trainers.rewards.judge import JudgeConfig, judge_for
from agentrl.types import Group, Status, Trajectory


@with_config(STRICT)
@dataclass(frozen=True)
class RewardConfig:
    terms: dict[str, float] = field(default_factory=lambda: {"env": 1.0})  # source name -> weight
    length_norm: int = 1024  # `length` = sampled tokens / this
    seed: int = 0  # for `random`
    judge: JudgeConfig | None = None  # for `judge`: the `[...reward.judge]` table

    def __post_init__(self) -> None:
        unknown = set(self.terms) - set(SOURCES)
        if unknown:
            raise ValueError(f"unknown reward sources {sorted(unknown)}; sources: {', '.join(SOURCES)}")
        if ("judge" in self.terms) != (self.judge is not None):
            raise ValueError("the judge source and the reward.judge table go together: give both (terms = {judge = "
                             "1.0} and a [grpo.reward.judge] table with backend, model, ...) or neither")
        if not self.terms:
            raise ValueError("reward.terms is empty: name at least one source, e.g. {env = 1.0}")
        if self.length_norm < 1:
            raise ValueError(f"length_norm must be >= 1, got {self.length_norm}")

    @property
    def confident(self) -> bool:
        """Whether a source is the policy's confidence, which the trainer scores at training time."""
        return any(k in CONFIDENCE_SOURCES for k in self.terms)

    def describe(self) -> str:
        """The sources and weights as a run's summary names them: `majority_vote 1, length -0.1`, `judge 1 [openai]`."""
        return ", ".join(f"{k} {w:g}" + (f" [{self.judge.backend}]" if k == "judge" else "")
                         for k, w in self.terms.items())


def _coin(seed: int, t: Trajectory, index: int) -> float:
    digest = hashlib.sha256(f"{seed}/{t.task_id}/{t.seed}/{index}".encode()).digest()
    return float(digest[0] & 1)


# a group's valid trajectories -> their values (None: missing, for a source that can fail to give one)
Source = Callable[[Sequence[Trajectory], RewardConfig], Sequence[float | None]]


def _majority_vote(ts: Sequence[Trajectory], cfg: RewardConfig) -> list[float]:
    label = majority_vote([t.answer for t in ts])
    return [float(label is not None and normalize_answer(t.answer) == label) for t in ts]


SOURCES: dict[str, Source] = {
    "env": lambda ts, cfg: [t.reward for t in ts],
    "outcome": lambda ts, cfg: [t.reward_components.get("outcome", 0.0) for t in ts],
    "process": lambda ts, cfg: [t.reward_components.get("process", 0.0) for t in ts],
    "majority_vote": _majority_vote,
    "format": lambda ts, cfg: [float(t.status is Status.OK and t.answer is not None) for t in ts],
    "random": lambda ts, cfg: [_coin(cfg.seed, t, i) for i, t in enumerate(ts)],
    "inverted": lambda ts, cfg: [1.0 - t.reward_components.get("outcome", 0.0) for t in ts],
    "length": lambda ts, cfg: [t.num_sampled / cfg.length_norm for t in ts],
    "judge": lambda ts, cfg: judge_for(cfg.judge).scores(ts),
    "rent": lambda ts, cfg: [confidence(t, "rent") for t in ts],
    "self_certainty": lambda ts, cfg: [confidence(t, "self_certainty") for t in ts],
}


def group_rewards(group: Group, cfg: RewardConfig, skip: Sequence[str] = ()) -> list[float | None]:
    """The training reward of each of the group's valid trajectories (errors get none: they are left
    out of baselines and of training), None where a source gave no value; without the sources in `skip`."""
    valid = group.valid
    totals: list[float | None] = [0.0] * len(valid)
    for name, weight in cfg.terms.items():
        if name in skip:
            continue
        for i, value in enumerate(SOURCES[name](valid, cfg)):
            totals[i] = None if value is None or totals[i] is None else totals[i] + weight * value
    return totals


def rewarded(group: Group, cfg: RewardConfig, skip: Sequence[str] = ()) -> tuple[list[Trajectory], list[float]]:
    """The group's trajectories that have a training reward (valid, none missing), and those rewards: what its
    baseline is made of and what is trained on (`skip`: as in `group_rewards`)."""
    pairs = [(t, r) for t, r in zip(group.valid, group_rewards(group, cfg, skip)) if r is not None]
    return [t for t, _ in pairs], [r for _, r in pairs]


def reward_metrics(groups: Sequence[Group], cfg: RewardConfig) -> dict[str, float]:
    """What the sources in use report about themselves: the majority vote's label quality, the judge's counts
    (`judge/missing` among them) and scores."""
    metrics = majority_vote_metrics(groups) if "majority_vote" in cfg.terms else {}
    if cfg.judge is not None:
        metrics.update(judge_for(cfg.judge).metrics())
    if cfg.confident:
        metrics.update(confidence_metrics(groups))
    return metrics


def majority_vote_metrics(groups: Sequence[Group]) -> dict[str, float]:
    """How good the pseudo-labels are: the fraction of groups whose majority answer is correct (judged by
    a trajectory that gave it, with outcome 1), and the mean share of the group that agrees with it."""
    correct, agreement, n = 0, 0.0, 0
    for g in groups:
        answers = [normalize_answer(t.answer) for t in g.valid]
        label = majority_vote([t.answer for t in g.valid])
        if label is None:
            continue
        n += 1
        holders = [t for t, a in zip(g.valid, answers) if a == label]
        correct += holders[0].reward_components.get("outcome", 0.0) >= 1.0
        agreement += len(holders) / len(g.valid)
    return {"majority_label_accuracy": correct / n if n else math.nan,
            "majority_agreement": agreement / n if n else math.nan}
