"""Per-step metrics to JSONL and TensorBoard, and the rollout statistics every loop reports."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

from agentrl.eval.metrics import summarize
from agentrl.types import Group


class MetricsLogger:
    """Appends one JSON object per step to `metrics.jsonl` and mirrors the numbers to TensorBoard."""

    def __init__(self, out_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        out_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(out_dir / "metrics.jsonl", "a")
        self._tb = SummaryWriter(str(out_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append `metrics` as the line of `step`; its finite numbers (nested dicts as `a/b` tags) go to TensorBoard."""
        self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self._jsonl.flush()
        for key, value in _flatten(metrics).items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        """Close the JSONL file and the TensorBoard writer."""
        self._jsonl.close()
        self._tb.close()


def rollout_metrics(groups: Sequence[Group], max_reward: float) -> dict[str, Any]:
    """`summarize` of every episode collected, plus the fraction of groups whose rewards do not vary
    (no learning signal) and the error and truncation fractions."""
    trajectories = [t for g in groups for t in g.trajectories]
    out = summarize(trajectories, max_reward)
    n = max(len(trajectories), 1)
    out["zero_variance_groups"] = sum(len(g.valid) > 1 and len({t.reward for t in g.valid}) == 1
                                      for g in groups) / max(len(groups), 1)
    out["error_frac"] = out["status"].get("error", 0) / n
    out["truncated_frac"] = out["status"].get("truncated", 0) / n
    return out


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(_flatten(v, key + "/") if isinstance(v, dict) else {key: v})
    return out
