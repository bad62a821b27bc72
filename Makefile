# DGXMM developer entry points.  `make test` is what CI runs (through .ci/run).
#
#   make demo   project venv, then `dgxmm serve --demo` (it makes .venv-litellm, runs LiteLLM)
#   make test   full bootstrap (Debian packages, Docker engine, venvs, sim image), then pytest
#   make lint   ruff check, ruff format --check, mypy --strict (configured in pyproject.toml),
#               scripts/unused-code (vulture: functions nothing calls),
#               scripts/import-cycles (product modules that import each other)
#
# PYTEST_ARGS adds pytest arguments: make test PYTEST_ARGS='-k runtime -x'

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

# The pinned LiteLLM proxy lives in its own venv; tests find it through LITELLM_BIN.
LITELLM_BIN ?= $(CURDIR)/.venv-litellm/bin/litellm
export LITELLM_BIN

# The real llama.cpp engine and its model (scripts/build-llama-server caches them outside the
# repository); the real-engine tests read LLAMA_SERVER and LLAMA_MODEL.
LLAMA_PATHS := $(shell scripts/build-llama-server --print 2>/dev/null)
LLAMA_SERVER ?= $(patsubst LLAMA_SERVER=%,%,$(filter LLAMA_SERVER=%,$(LLAMA_PATHS)))
LLAMA_MODEL ?= $(patsubst LLAMA_MODEL=%,%,$(filter LLAMA_MODEL=%,$(LLAMA_PATHS)))
export LLAMA_SERVER LLAMA_MODEL

# The real vLLM (CPU build) and its Hugging Face model folder (scripts/build-vllm caches them
# outside the repository); the real-vLLM tests read VLLM_PYTHON and VLLM_MODEL.
VLLM_PATHS := $(shell scripts/build-vllm --print 2>/dev/null)
VLLM_PYTHON ?= $(patsubst VLLM_PYTHON=%,%,$(filter VLLM_PYTHON=%,$(VLLM_PATHS)))
VLLM_MODEL ?= $(patsubst VLLM_MODEL=%,%,$(filter VLLM_MODEL=%,$(VLLM_PATHS)))
export VLLM_PYTHON VLLM_MODEL

.PHONY: help demo test lint bootstrap venv

help:
	@sed -n '2,10p' Makefile | sed 's/^# \{0,1\}//'

venv:
	@scripts/bootstrap --venv-only

bootstrap:
	@scripts/bootstrap

demo: venv
	$(VENV)/bin/dgxmm serve --demo

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) scripts/unused-code
	$(PY) scripts/import-cycles

# Two lanes (tests/conftest.py, scripts/test-lanes): the tests that mostly wait in real time
# run beside the rest, which run in file order.  A run that collects no test is a failure.
test: bootstrap
	@PY=$(PY) scripts/test-lanes $(PYTEST_ARGS)
