# meshshard: `make demo` and `make test` each set up .venv on a fresh machine first.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# The CPU build of torch first (a plain `torch` requirement would pull a multi-GB CUDA
# build); pyproject's range accepts it, and GPU users bring their own CUDA build.
TORCH   ?= torch==2.13.0
# ml_dtypes 0.7.0 takes 1.5 s to import (0.6.0: 0.19 s), and every process that imports
# JAX pays it: each Ray host-actor, each test worker and subprocess (BUILD_NOTES.md,
# "Import time").  JAX 0.10 accepts >=0.5.
ML_DTYPES ?= ml_dtypes>=0.5,<0.7

.PHONY: setup demo test test-fast lint format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]" "$(ML_DTYPES)"
	touch $(STAMP)

demo: setup
	$(PY) examples/train_gpt.py

# Everything: unit, doctests (every package module), slow and Ray tiers.
test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -n 2 --dist loadgroup

# The fast tier only (no Ray, nothing slow): the loop to run while editing.
test-fast: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -m fast

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: setup
	$(PY) benchmarks/pipeline_step.py --json benchmarks/pipeline_step.json

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
