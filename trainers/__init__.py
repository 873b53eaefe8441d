"""Losses, advantages and training loops (GRPO, SFT, DPO) and the research methods (tandem, tango).

The loss and advantage functions are pure functions of tensors (STYLE.md #5), re-exported here; each
variant is one function plus one entry in `ADVANTAGES` or `POLICY_LOSSES`.
"""

from agentrl.trainers.advantages import (
    ADVANTAGES,
    gae,
    grpo_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    rloo_advantages,
    turn_level_group_advantages,
    turn_rewards_to_tokens,
)
from agentrl.trainers.losses import (
    AGG_MODES,
    KL_KINDS,
    POLICY_LOSSES,
    PolicyLossConfig,
    aggregate,
    clip_cov_loss,
    dpo_loss,
    gspo_loss,
    kl_cov_loss,
    kl_estimate,
    kl_in_reward,
    kl_loss,
    masked_mean,
    ppo_clip_loss,
    value_loss,
)

__all__ = [
    "ADVANTAGES", "AGG_MODES", "KL_KINDS", "POLICY_LOSSES", "PolicyLossConfig", "aggregate",
    "clip_cov_loss", "dpo_loss", "gae", "grpo_advantages", "gspo_loss", "kl_cov_loss",
    "kl_estimate", "kl_in_reward", "kl_loss", "masked_mean", "masked_whiten", "ppo_clip_loss",
    "reinforce_pp_advantages", "rloo_advantages", "turn_level_group_advantages", "turn_rewards_to_tokens",
    "value_loss",
]
