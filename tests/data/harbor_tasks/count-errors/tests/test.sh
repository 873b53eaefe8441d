#!/bin/bash
# The expected count is fixed here: the agent's box never held this file.
if [ "$(tr -d '[:space:]' < /app/answer.txt 2>/dev/null)" = "48" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
