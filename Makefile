# Set-up and checks. `make demo` and `make test` are all a fresh clone needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch that this project's machines carry; pip takes it from local disk.
TORCH  := torch==2.13.0

.PHONY: venv demo test train-tiny clean

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

test: venv
	$(PY) -m pytest -q

# Retrain the embedded default model (installs the Debian package `fortunes`; ~25-40 min on CPU).
# Not part of `test`: CI uses the committed checkpoint.
train-tiny: venv
	recipes/cpu/train-tiny.sh

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
