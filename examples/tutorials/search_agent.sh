#!/usr/bin/env bash
# Tutorial: train a Search-R1 agent on CPU (docs/tutorials/search-agent.md).
# The tiny model learns to copy, to read answers out of documents, to search like an expert, then GRPO; held-out
# suites are evaluated before and after. TUTORIAL_SMALL=1 (what CI runs) shrinks every stage; the commands
# are the same.
set -euo pipefail
MODEL=${MODEL:-$HOME/.cache/agentrl/models/tiny-search}
OUT=${OUT:-runs/tutorial-search}
SMALL=()
if [ "${TUTORIAL_SMALL:-0}" = 1 ]; then
  SMALL=(--set warmup.steps=20 --set warmup.context_steps=4 --set warmup.context_vocab_steps=4
         --set warmup.context_episodes=8 --set env_kwargs.train_worlds=2 --set sft.0.episodes=16
         --set sft.1.episodes=16 --set sft.1.config.epochs=1
         --set eval.n=2 --set grpo.steps=1 --set grpo.tasks_per_step=2
         --set grpo.group_size=2)
fi

agentrl model init "$MODEL" --corpus search  # the 5 M-parameter model; its tokenizer also learned the corpus
agentrl envs check search/r1-v0             # API checker + gold answers get the maximum reward
agentrl envs show search/r1-v0             # what the model reads at the start of an episode
agentrl train recipes/cpu_search_r1_train.toml --model "$MODEL" --out-dir "$OUT" ${SMALL[@]+"${SMALL[@]}"}
python -c "import json, sys; s = json.load(open(sys.argv[1])); print({k: s[k] for k in ('before', 'after') if k in s})" \
  "$OUT/summary.json"
