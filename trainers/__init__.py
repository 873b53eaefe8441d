"""Losses and training loops (GRPO, PPO, SFT): the trainers issue fills this package."""
