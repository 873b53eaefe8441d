#!/usr/bin/env bash
# Tutorial: tandem (senior/junior) rollouts against plain GRPO from one warm start (docs/tutorials/tandem.md).
# TUTORIAL_SMALL=1 (what CI runs) shrinks every stage; the commands are the same.
set -euo pipefail
MODEL=${MODEL:-$HOME/.cache/agentrl/models/tiny}
OUT=${OUT:-runs/tutorial-tandem}
WARM=() RL=()
if [ "${TUTORIAL_SMALL:-0}" = 1 ]; then
  WARM=(--set warmup.steps=20 --set sft.episodes=16 --set sft.config.epochs=1 --set eval.n=2)
  RL=(--steps 1 --set grpo.tasks_per_step=2 --set grpo.group_size=2 --set eval.n=2)
fi
for setting in ${TUTORIAL_RL_SET:-}; do RL+=(--set "$setting"); done  # the tests' own settings, if any

agentrl model init "$MODEL"
# One warm start (copy warm-up, then SFT on an imperfect expert) shared by both methods.
agentrl train recipes/cpu_math_warmstart_train.toml --model "$MODEL" --out-dir "$OUT/warmstart" ${WARM[@]+"${WARM[@]}"}
# The same budget and seed: plain GRPO, then tandem, where a frozen junior (the warm start) writes each word
# of a response with probability p_junior and the senior (the policy) the rest; the junior's tokens stay in
# the trajectory verbatim but out of the loss mask.
agentrl train recipes/cpu_math_grpo_train.toml --model "$OUT/warmstart/sft_model" --out-dir "$OUT/grpo" ${RL[@]+"${RL[@]}"}
agentrl train recipes/cpu_math_tandem_train.toml --model "$OUT/warmstart/sft_model" --out-dir "$OUT/tandem" \
  ${RL[@]+"${RL[@]}"}
agentrl compare "$OUT/grpo" "$OUT/tandem"           # held-out success before/after with 95% CIs
