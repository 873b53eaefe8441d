#!/usr/bin/env bash
# Tutorial: a code agent in the Docker sandbox (docs/tutorials/code-agent.md).
# Needs a Docker daemon and the sandbox image: `make setup-docker`. TUTORIAL_SMALL=1 (what CI runs) shrinks
# every stage; the commands are the same.
set -euo pipefail
MODEL=${MODEL:-$HOME/.cache/agentrl/models/tiny}
OUT=${OUT:-runs/tutorial-code}
SMALL=()
if [ "${TUTORIAL_SMALL:-0}" = 1 ]; then
  SMALL=(--set sft.episodes=8 --set eval.n=2 --set grpo.steps=1 --set grpo.tasks_per_step=1
         --set grpo.group_size=2 --set grpo.rollout.sampling.max_tokens=64
         --set eval.rollout.sampling.max_tokens=64)
fi

agentrl model init "$MODEL"
agentrl envs check code/generated-v0 --n-tasks 2   # gold solutions pass the hidden tests in real sandboxes
agentrl train recipes/cpu_code_train.toml --model "$MODEL" --out-dir "$OUT" ${SMALL[@]+"${SMALL[@]}"}
tail -n 2 "$OUT/metrics.jsonl"
