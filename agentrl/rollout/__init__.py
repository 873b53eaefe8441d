"""From policy and envs to trajectories.

- `engine`: `RolloutEngine`, many episodes at once, each an exact token trajectory
- `ray_pool`: the envs of those episodes in Ray worker actors
- `jsonl`: trajectories on disk, one JSON line each
"""
