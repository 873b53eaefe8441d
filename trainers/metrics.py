"""Per-step metrics to JSONL and TensorBoard, and the rollout statistics every loop reports."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from agentrl.types import Group, Status


class MetricsLogger:
    """Appends one JSON object per step to `metrics.jsonl` and mirrors the numbers to TensorBoard."""

    def __init__(self, out_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        out_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(out_dir / "metrics.jsonl", "a")
        self._tb = SummaryWriter(str(out_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self._jsonl.flush()
        for key, value in _flatten(metrics).items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        self._jsonl.close()
        self._tb.close()


def rollout_metrics(groups: Sequence[Group], max_reward: float) -> dict[str, Any]:
    """Reward (mean and per component, over non-error episodes), success, zero-variance group fraction,
    error and truncation fractions with their reasons."""
    from agentrl.evaluation import is_success

    trajectories = [t for g in groups for t in g.trajectories]
    valid = [t for t in trajectories if t.status is not Status.ERROR]
    n, n_valid = len(trajectories), max(len(valid), 1)
    components: dict[str, float] = Counter()
    for t in valid:
        components.update(t.reward_components)
    zero_var = [g for g in groups if len(g.valid) > 1 and len({t.reward for t in g.valid}) == 1]
    return {
        "reward": sum(t.reward for t in valid) / n_valid,
        "reward_components": {k: v / n_valid for k, v in components.items()},
        "success": sum(is_success(t, max_reward) for t in valid) / n_valid,
        "zero_variance_groups": len(zero_var) / max(len(groups), 1),
        "error_frac": sum(t.status is Status.ERROR for t in trajectories) / n,
        "truncated_frac": sum(t.status is Status.TRUNCATED for t in trajectories) / n,
        "reasons": dict(Counter(t.reason for t in trajectories if t.reason).most_common(3)),
        "turns": sum(len(t.turns) for t in trajectories) / n,
        "sampled_tokens": sum(t.num_sampled for t in trajectories),
    }


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(_flatten(v, key + "/") if isinstance(v, dict) else {key: v})
    return out
