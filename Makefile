# The commands of the README: `make run`, `make test` and `make lint`; `make gpu-check` on
# the first machine with a GPU (scripts/gpu_check.sh; GPU_CHECK_ARGS=--dry-run prints its plan).
VENV ?= .venv
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: setup run test lint gpu-check

setup:
	@PLUGSERVE_VENV=$(VENV) ./scripts/setup.sh

run:
	@PLUGSERVE_VENV=$(VENV) PLUGSERVE_SETUP=run ./scripts/setup.sh
	$(VENV)/bin/plugserve generate --chat "$(PROMPT)"

# The per-plugin test matrix (noxfile.py): the core's tests, each plugin's tests with only the
# core and what the plugin declares, then the tests across plugins. NOX_ARGS="-s core" runs one
# session; `$(VENV)/bin/python -m pytest -q` runs everything in one process instead.
test: setup
	$(VENV)/bin/nox $(NOX_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy core $(dir $(wildcard plugins/*/plugserve_*/__init__.py))

gpu-check:
	./scripts/gpu_check.sh $(GPU_CHECK_ARGS)
