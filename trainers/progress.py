"""The lines `agentrl train` prints while it runs: one per RL step, and about ten per warm-start stage."""

from __future__ import annotations

from typing import Any, Callable


def progress_line(step: int, steps: int, m: dict[str, Any]) -> str:
    """One RL step: reward, success, entropy, KL and timing; asynchronous runs add the staleness of the groups."""
    line = f"step {step}/{steps}  reward {m['mean_reward']:.3f}  success {m['success']:.3f}  "
    if "entropy" in m:  # KL when the policy loss reports it (a user's loss may not)
        line += f"entropy {m['entropy']:.3f}  " + (f"kl {m['approx_kl']:.4f}  " if "approx_kl" in m else "")
    else:  # the loop skipped every row: no forward pass, so no entropy or KL to show
        line += "no update (every row's advantage 0)  "
    if "staleness" not in m:
        return line + f"rollout {m['time']['rollout']:.1f}s train {m['time']['train']:.1f}s"
    staleness = " ".join(f"{k}:{n}" for k, n in m["staleness"].items())  # asynchronous: groups by staleness
    return line + (f"waited {m['time']['rollout']:.1f}s train {m['time']['train']:.1f}s  staleness {staleness}  "
                   f"stale dropped {m['stale_groups']}")


def stage_progress(steps: int, log: Callable[[str], None], stage: str, key: str) -> Callable[[dict], None]:
    """Logs `key` about every tenth of a stage's steps (an upper bound for SFT: the filter may drop demos)."""
    done = 0

    def on_step(row: dict) -> None:
        nonlocal done
        done += 1
        if done % max(1, steps // 10) == 0:
            log(f"{stage} step {done}/{steps}  {key.replace('_', ' ')} {row[key]:.3f}")

    return on_step


def mean_of_last(history: list[dict], key: str, n: int = 50) -> float:
    """The mean of `key` over the last `n` rows of a stage's history."""
    return sum(row[key] for row in history[-n:]) / len(history[-n:])
