#!/usr/bin/env bash
# A separate virtual environment with llama.cpp's Python bindings built for this machine's
# CPU, for `plugserve bench latency --compare llamacpp --llamacpp-python .venv-llamacpp/bin/python`
# and benchmarks/llamacpp_quantize.py. Never part of `make setup`, the project's own
# environment or CI: it compiles llama.cpp from the source distribution (about ten minutes
# on two cores).
#
#   benchmarks/setup_llamacpp.sh [VENV]      # default .venv-llamacpp (ignored by git)
#
# The build is native (-DGGML_NATIVE=ON: the ISA of the machine that builds it, as a user
# who builds llama.cpp for their own CPU gets); CMAKE_ARGS adds to that. It is idempotent:
# an environment whose llama_cpp already imports at the pinned version is left as it is
# (LLAMACPP_REBUILD=1 forces a rebuild, e.g. after moving to another machine). On a CPU with
# AMX the build leaves AMX out (see below; LLAMACPP_AMX=on keeps it).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-${PLUGSERVE_LLAMACPP_VENV:-.venv-llamacpp}}"
PY="${PYTHON:-python3}"
PACKAGE="${LLAMACPP_PACKAGE:-llama-cpp-python==0.3.36}"
VERSION="${PACKAGE##*==}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup_llamacpp: creating $VENV" >&2
    "$PY" -m venv "$VENV"
fi
if [ "${LLAMACPP_REBUILD:-0}" != 1 ] && "$VENV/bin/python" - "$VERSION" <<'PYEOF' 2>/dev/null
import sys
import llama_cpp
sys.exit(0 if llama_cpp.__version__ == sys.argv[1] else 1)
PYEOF
then
    echo "setup_llamacpp: $VENV already has llama-cpp-python $VERSION (LLAMACPP_REBUILD=1 rebuilds)" >&2
else
    pip=("$VENV/bin/python" -m pip)
    "${pip[@]}" install --quiet --upgrade pip setuptools wheel
    # numpy and the gguf package: the bindings need numpy; gguf writes the F32 file that
    # benchmarks/llamacpp_quantize.py quantizes from.
    "${pip[@]}" install --quiet numpy gguf
    export CMAKE_ARGS="-DGGML_NATIVE=ON ${CMAKE_ARGS:-}"
    if grep -qw amx_tile /proc/cpuinfo 2>/dev/null && [ "${LLAMACPP_AMX:-off}" != on ]; then
        # ggml's AMX matmul (llama-cpp-python 0.3.36) stopped with a general protection
        # fault (ldtilecfg) at the first token on a Xeon that reports AMX: build natively
        # minus AMX unless LLAMACPP_AMX=on. Wrappers put -mno-amx-* after -march=native.
        wrappers="$(cd "$VENV" && pwd)/no-amx"  # absolute: cmake runs elsewhere
        mkdir -p "$wrappers"
        for cc in gcc g++; do
            printf '#!/bin/sh\nexec %s "$@" -mno-amx-tile -mno-amx-int8 -mno-amx-bf16\n' \
                "$(command -v "$cc")" > "$wrappers/$cc"
            chmod +x "$wrappers/$cc"
        done
        CMAKE_ARGS="$CMAKE_ARGS -DCMAKE_C_COMPILER=$wrappers/gcc"
        CMAKE_ARGS="$CMAKE_ARGS -DCMAKE_CXX_COMPILER=$wrappers/g++"
        echo "setup_llamacpp: this CPU reports AMX; building without it (LLAMACPP_AMX=on keeps it)" >&2
    fi
    export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
    echo "setup_llamacpp: building $PACKAGE from source with CMAKE_ARGS='$CMAKE_ARGS'" >&2
    "${pip[@]}" install --no-binary llama-cpp-python --no-cache-dir --force-reinstall \
        --no-deps "$PACKAGE"
    "${pip[@]}" install --quiet "$PACKAGE"  # its dependencies (typing-extensions, jinja2, ...)
fi
echo "setup_llamacpp: checking that llama_cpp imports" >&2
"$VENV/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__); print(llama_cpp.llama_print_system_info().decode())"
echo "setup_llamacpp: done; use --llamacpp-python $VENV/bin/python" >&2
