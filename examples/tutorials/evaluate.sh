#!/usr/bin/env bash
# Tutorial: evaluate a model on held-out suites and read the report (docs/tutorials/evaluate.md).
# TUTORIAL_SMALL=1 (what CI runs) evaluates fewer tasks; the commands are the same.
set -euo pipefail
MODEL=${MODEL:-$HOME/.cache/agentrl/models/tiny}
OUT=${OUT:-runs/tutorial-eval}
N=50
if [ "${TUTORIAL_SMALL:-0}" = 1 ]; then N=4; fi

agentrl model init "$MODEL"
agentrl suites                                       # the registered suites
agentrl eval --suite search/heldout --model "$MODEL" --n "$N" --k 1,4 --max-tokens 48 --out "$OUT"
agentrl eval --suite search/heldout --model "$MODEL" --n "$N" --k 1,4 --max-tokens 48 --out "$OUT"  # resumes: nothing to do
head -n 30 "$OUT/report.md"
ls "$OUT"                                            # report.md, report.html, viewer.html, the episodes
