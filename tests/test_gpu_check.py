"""`scripts/gpu_check.sh --cpu`: the checks prepared for a borrowed GPU run, and pass, on CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.slow
def test_the_gpu_checks_pass_on_cpu():
    out = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHON": sys.executable}, timeout=600)
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["check"] for r in lines[:-1]] == ["mixed_precision", "chunked_head", "fsdp2_world_1",
                                                "checkpoint_resume", "sampler_tokens_per_s"]
    assert lines[-1]["ok"] and out.returncode == 0, lines
    assert lines[0]["weights_changed"] > 0.9 and lines[1]["max_abs_diff"] <= 1e-4 and lines[3]["bit_exact"]
