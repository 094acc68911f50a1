# The commands of the README: `make run`, `make test` and `make lint`; `make gpu-check` on
# the first machine with a GPU (scripts/gpu_check.sh; GPU_CHECK_ARGS=--dry-run prints its plan).
VENV ?= .venv
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: setup run test lint gpu-check

setup:
	@PLUGSERVE_VENV=$(VENV) ./scripts/setup.sh

run: setup
	$(VENV)/bin/plugserve generate --chat "$(PROMPT)"

test: setup
	$(VENV)/bin/python -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy core $(dir $(wildcard plugins/*/plugserve_*/__init__.py))

gpu-check:
	./scripts/gpu_check.sh $(GPU_CHECK_ARGS)
