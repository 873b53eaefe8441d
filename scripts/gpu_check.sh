#!/usr/bin/env bash
# The GPU path's checks (scripts/gpu_check.py): torch and transformers only, at most 8 minutes.
#   bash scripts/gpu_check.sh          # on CUDA
#   bash scripts/gpu_check.sh --cpu    # on CPU, smaller (the test suite runs this)
# The last line is one JSON object: {"ok": ..., "failed": [...], "device": ..., "torch": ...}.
set -euo pipefail
cd "$(dirname "$0")/.."
exec timeout 480 "${PYTHON:-python}" scripts/gpu_check.py "$@"
