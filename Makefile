# Set-up and checks. `make demo` and `make test` are all a fresh clone needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch that this project's machines carry; pip takes it from local disk.
TORCH  := torch==2.13.0

.PHONY: venv demo lint test train-tiny train-assistant xla-check xla-ops clean

# Idempotent: re-running only installs what pyproject.toml changed.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev,serve]" "$(TORCH)"
	touch $@

venv: $(VENV)/.installed

# The main job on the embedded default port: SEQ_MATCH of DenseExperts against HF eager.
demo: venv
	$(VENV)/bin/neuron-moe info --model tiny-gemma4-moe
	$(VENV)/bin/neuron-moe validate --model tiny-gemma4-moe --backend dense_masked --max-new-tokens 32

# ruff's lint rules and formatting (config in pyproject.toml); CI runs this before the tests.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The suite on TEST_WORKERS processes (pytest-xdist; tests handed out as workers free up), each with
# OMP_NUM_THREADS torch threads (default 1: two workers fill two cores), in a random order (pytest-randomly;
# SEED=N replays one; the seed and thread count are printed at the end).
TEST_WORKERS ?= 2
SEED         ?=
test: venv
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal \
		$(if $(SEED),--randomly-seed=$(SEED)) --durations=15

# Retrain the embedded default model (installs the Debian package `fortunes`; about an hour on CPU).
# Not part of `test`: CI uses the committed checkpoint.
train-tiny: venv
	recipes/cpu/train-tiny.sh

# Retrain the tiny model's MTP assistant (ports/tiny-gemma4-moe-assistant) on the tiny model's corpus
# (build/tiny/corpus, as train-tiny builds it; built here if missing, from the Debian package `fortunes`).
train-assistant: venv
	test -d build/tiny/corpus || $(VENV)/bin/neuron-moe build-corpus --out build/tiny/corpus
	$(VENV)/bin/neuron-moe train-assistant --corpus build/tiny/corpus --out ports/tiny-gemma4-moe-assistant \
		--steps 800 --batch-size 2 --queries 128 --task-share 0.05 --seed 0

# The XLA lowering check (bench/xla_check.py): the static graphs through torch-xla on the CPU; its report
# goes to bench/results/xla-check.{md,json}, each graph's HLO text to build/xla-check-hlo/.
# Its own venv, because torch-xla 2.9 needs torch 2.9 (the Neuron SDK 2.31 pair) and PyPI's
# torch 2.9 is a CUDA build: about 7 GB, so it is cached here and kept out of `make test` and CI.
XLA_VENV := .venv-xla
XLA_PINS := torch==2.9.0 torch-xla==2.9.0

$(XLA_VENV)/.installed: pyproject.toml
	test -x $(XLA_VENV)/bin/python || $(PYTHON) -m venv $(XLA_VENV)
	$(XLA_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(XLA_VENV)/bin/python -m pip install --quiet $(XLA_PINS)
	$(XLA_VENV)/bin/python -m pip install --quiet -e . $(XLA_PINS)
	touch $@

xla-check: $(XLA_VENV)/.installed
	PJRT_DEVICE=CPU $(XLA_VENV)/bin/python -m bench.xla_check --hlo build/xla-check-hlo

# The allow-list of lowered ops the tests hold the graphs to (neuron_moe/static/xla_lowered_ops.txt),
# from the XLA check's result once every run of it passed.
xla-ops: venv
	$(PY) -m tools.xla_ops bench/results/xla-check.json

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
