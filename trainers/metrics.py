"""Per-step metrics to JSONL and TensorBoard, and the rollout statistics every loop reports."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from agentrl.eval.metrics import summarize
from agentrl.rollout.jsonl import JsonlWriter, read_records, write_jsonl
from agentrl.types import Group


class NonFiniteLoss(ArithmeticError):
    """A loss or gradient norm that is NaN or infinite: training stops there rather than train on garbage."""


def check_finite(where: str, metrics: dict[str, Any]) -> None:
    """Raise `NonFiniteLoss`, naming `where` (the step), if a loss or gradient norm in `metrics` (nested dicts
    included) is not finite; called before the step is logged or checkpointed, so the last checkpoint is sound."""
    bad = {k: v for k, v in _flatten(metrics).items()
           if k.endswith(("loss", "grad_norm")) and isinstance(v, float) and not math.isfinite(v)}
    if bad:
        raise NonFiniteLoss(f"{where}: non-finite {bad}; stopped before logging or checkpointing it (the last "
                            "checkpoint is intact)")


class EveryEpisodeFailed(RuntimeError):
    """Every episode of an RL step ended in error (a dead sandbox daemon, a server that will not restart): training
    stops there rather than run on with nothing to learn from."""


def check_step(where: str, metrics: dict[str, Any]) -> None:
    """`check_finite`, then `EveryEpisodeFailed` with the most common reason if no episode of the step ended without
    error; before the step is logged or checkpointed, so that the same command resumes at this step once it is fixed."""
    check_finite(where, metrics)
    if metrics.get("episodes") and metrics["error_frac"] == 1.0:
        reason, count = max(metrics["reasons"].items(), key=lambda item: item[1], default=("no reason given", 0))
        raise EveryEpisodeFailed(f"{where}: all {metrics['episodes']} episodes ended in error ({count} of them: "
                                 f"{reason}); nothing to train on, so the run stops here. Fix the cause and run the "
                                 "same command again: it resumes from the last checkpoint.")


class MetricsLogger:
    """Appends one JSON object per step to `metrics.jsonl` and mirrors the numbers to TensorBoard."""

    def __init__(self, out_dir: Path, start: int = 0):
        """A run resumed at step `start` keeps only the lines of steps up to it: later ones were logged after
        the checkpoint it resumes from and are about to be redone, and a line cut by a crash is dropped."""
        from torch.utils.tensorboard import SummaryWriter

        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "metrics.jsonl"
        rows = read_records(path, repair=True) if path.exists() else []
        if any(row["step"] > start for row in rows):
            write_jsonl([row for row in rows if row["step"] <= start], path)
        self._jsonl = JsonlWriter(path, append=True)
        self._tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=start + 1)  # forgets them too

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append `metrics` as the line of `step`; its finite numbers (nested dicts as `a/b` tags) go to TensorBoard."""
        self._jsonl.write({"step": step, **metrics})
        for key, value in _flatten(metrics).items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        """Close the JSONL file and the TensorBoard writer."""
        self._jsonl.close()
        self._tb.close()


def correlation(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson's correlation of x and y; NaN where either is constant."""
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


def rollout_metrics(groups: Sequence[Group], max_reward: float) -> dict[str, Any]:
    """`summarize` of every episode collected, plus the fraction of groups whose rewards do not vary
    (no learning signal) and the error and truncation fractions (of episodes)."""
    out = summarize([t for g in groups for t in g.trajectories], max_reward)
    n = max(out["episodes"], 1)
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
