# The index of commands. Each target sets up a project-local virtual environment (.venv) the
# first time, unless a virtual environment is already active, in which case it uses that one.

ifdef VIRTUAL_ENV
VENV := $(VIRTUAL_ENV)
PY := python
else
VENV := .venv
PY := .venv/bin/python
endif
# The run targets install the runtime packages (requirements.txt), the others the test tier too (requirements-dev.txt),
# both with CI's exact versions (constraints.txt) less its torch line where the environment has a torch >= the floor.
RUNTIME := $(VENV)/.nanorl-runtime
STAMP := $(VENV)/.nanorl-installed
PINS := $(VENV)/.nanorl-constraints.txt

.PHONY: install test test-slow test-cuda lint format train eval gpu-check bench tiny-model tiny-tool-model experiments experiments-quick plot tour clean

install: $(STAMP)

$(PINS): constraints.txt
	@[ -x $(VENV)/bin/python ] || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if $(PY) -c "import graphs; graphs.check_torch()" 2>/dev/null; then grep -v '^torch==' constraints.txt; else cat constraints.txt; fi >$@

$(RUNTIME): requirements.txt $(PINS)
	$(PY) -m pip install -q -r requirements.txt -c $(PINS)
	@touch $@

$(STAMP): $(RUNTIME) requirements-dev.txt
	$(PY) -m pip install -q -r requirements-dev.txt -c $(PINS)
	@touch $@

test: $(STAMP)          ## the fast tier of the CPU tests: everything but end-to-end and multi-process runs (under 3 min)
	$(PY) -m pytest -m "not slow and not cuda" tests

test-slow: $(STAMP)     ## the slow tier: whole training runs, subprocesses, torchrun, golden runs (CI runs both tiers)
	$(PY) -m pytest -m "slow and not cuda" tests

test-cuda: $(STAMP)     ## the CUDA tier on one GPU (tests/test_cuda.py, under 4 min): every test skips without CUDA
	$(PY) -m pytest -m cuda tests/test_cuda.py

lint: $(STAMP)          ## ruff: lint rules and formatting, as configured in pyproject.toml (CI runs it)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)        ## apply ruff's formatting and safe fixes
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

train: $(RUNTIME)       ## the bundled default: GRPO-MA on the synthetic task, a few minutes on a CPU
	$(PY) train.py $(ARGS)

eval: $(RUNTIME)        ## evaluate the bundled model (or MODEL=path) on held-out prompts
	$(PY) eval.py --model $(or $(MODEL),assets/tiny-model) $(ARGS)

gpu-check: $(STAMP)     ## the checks that need a CUDA GPU, as one table (ARGS=--cpu: on CPU, tiny model)
	PYTHON=$(PY) bash bench/gpu_check.sh $(ARGS)

bench: $(STAMP)         ## speed comparisons, printed as ratios
	$(PY) bench/bench_sampler.py
	$(PY) bench/bench_tree.py
	$(PY) bench/bench_trl.py
	$(PY) bench/bench_trl.py --no-share-prompt
	$(PY) bench/bench_humaneval.py

experiments: $(STAMP)   ## the papers' claims: 3 seeds per configuration, about 2.3 hours on 2 cores (skips finished runs)
	$(PY) experiments/run.py

experiments-quick: $(STAMP)  ## the same suite, 1 seed x a tenth of the steps: under 15 minutes
	$(PY) experiments/run.py --quick

tiny-model: $(RUNTIME)  ## rebuild the bundled tiny model from scratch (supervised warm start)
	$(PY) sft.py

tiny-tool-model: $(RUNTIME)  ## rebuild assets/tiny-tool-model: the tiny shape warm-started on products, 30% with the Python tool
	$(PY) sft.py --task synthetic-mul --tool-demos 0.3 --steps 600 --out assets/tiny-tool-model

tour: $(STAMP)          ## docs/tour.md: one GRPO step of grpo_minimal.py, its real tensors and lines of code (tested: stale fails)
	$(PY) docs/tour.py

plot: $(STAMP)          ## plot the runs under runs/, one PNG per task and model (runs/plot-TASK-MODEL.png; one: runs/plot.png)
	$(PY) eval.py --plot $(dir $(wildcard runs/*/metrics.jsonl)) --out runs/plot.png

clean:
	rm -rf .pytest_cache __pycache__ tests/__pycache__ bench/__pycache__
