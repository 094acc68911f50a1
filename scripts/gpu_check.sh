#!/usr/bin/env bash
# One command for the first machine with a GPU (`make gpu-check`): install the GPU extras, run
# every `-m gpu` test, the conformance suite of each GPU attention backend on cuda, the
# transformers-identity engine tests on cuda and a short bench; print one summary table and
# exit non-zero if any step failed.
#
#   scripts/gpu_check.sh               run every step (logs in gpu-check-logs/)
#   scripts/gpu_check.sh --dry-run     print the plan (step <TAB> command) and exit
#   scripts/gpu_check.sh --only NAME   run the steps whose name starts with NAME (repeatable)
#   scripts/gpu_check.sh --plan FILE   run the steps of FILE (lines as --dry-run prints them)
#
# Environment: PLUGSERVE_VENV (default .venv); PLUGSERVE_TORCH_INDEX_URL, the index a CUDA build
# of the pinned torch comes from when the venv holds a CPU-only one (default PyTorch's CUDA
# 12.8 index); GPU_CHECK_LOGS (default gpu-check-logs); GPU_CHECK_STEP_TIMEOUT (seconds per
# step, default 3600).
set -uo pipefail
cd "$(dirname "$0")/.."

VENV="${PLUGSERVE_VENV:-.venv}"
PY="$VENV/bin/python"
LOGS="${GPU_CHECK_LOGS:-gpu-check-logs}"
STEP_TIMEOUT="${GPU_CHECK_STEP_TIMEOUT:-3600}"
TORCH_PIN="torch==2.13.0"
TORCH_INDEX="${PLUGSERVE_TORCH_INDEX_URL:-https://download.pytorch.org/whl/cu128}"
GPU_BACKENDS=(triton flashinfer fa3)
IDENTITY_BACKENDS=(torch_native triton)  # fp32 backends: token-identical to transformers fp32
BENCH_BACKENDS=(torch_native triton flashinfer fa3)

plan() {
    printf 'setup\tPLUGSERVE_VENV=%s ./scripts/setup.sh\n' "$VENV"
    printf 'torch-cuda\t%s -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" || { %s -m pip uninstall -y torch && %s -m pip install "%s" --index-url %s; }; %s -c "import torch, sys; print(%s, torch.__version__, %s, torch.version.cuda); sys.exit(0 if torch.version.cuda else 1)"\n' \
        "$PY" "$PY" "$PY" "$TORCH_PIN" "$TORCH_INDEX" "$PY" "'torch'" "'CUDA'"
    printf 'gpu-extras\t%s -m pip install -e "plugins/attention_flashinfer[cuda]" -e "plugins/attention_fa3[cuda]"\n' "$PY"
    printf 'device\t%s -c "import torch; assert torch.cuda.is_available(), %s; print(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0), %s, torch.version.cuda)"\n' \
        "$PY" "'torch sees no CUDA device'" "'CUDA'"
    printf 'plugins\t%s/bin/plugserve plugins\n' "$VENV"
    printf 'gpu-tests\t%s -m pytest -m gpu -q -rs -p no:cacheprovider\n' "$PY"
    local backend
    for backend in "${GPU_BACKENDS[@]}"; do
        printf 'conformance-%s\t%s/bin/plugserve conformance --attention %s --device cuda -- -q -rs -p no:cacheprovider\n' \
            "$backend" "$VENV" "$backend"
    done
    for backend in "${IDENTITY_BACKENDS[@]}"; do
        printf 'identity-%s\tPLUGSERVE_DEVICE=cuda PLUGSERVE_ATTENTION=%s %s -m pytest -q -rs -p no:cacheprovider tests/core/test_greedy_vs_hf.py\n' \
            "$backend" "$backend" "$PY"
    done
    for backend in "${BENCH_BACKENDS[@]}"; do
        printf 'bench-%s\t%s/bin/plugserve bench throughput --device cuda --dtype bfloat16 --page-size 16 --attention %s --num-seqs 32 --max-input-len 512 --max-output-len 128 --json > %s/bench-%s.json && %s scripts/bench_line.py %s/bench-%s.json\n' \
            "$backend" "$VENV" "$backend" "$LOGS" "$backend" "$PY" "$LOGS" "$backend"
    done
}

dry_run=0
plan_file=""
only=()
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --only) shift; only+=("${1:?--only needs a step name}") ;;
        --plan) shift; plan_file="${1:?--plan needs a file}" ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$1' (use --dry-run, --only NAME, --plan FILE)" >&2
           exit 2 ;;
    esac
    shift
done

if [ -n "$plan_file" ]; then
    steps=$(grep -v '^[[:space:]]*\(#\|$\)' "$plan_file") || {
        echo "gpu_check.sh: no steps in $plan_file" >&2; exit 2; }
else
    steps=$(plan)
fi
if [ ${#only[@]} -gt 0 ]; then
    selected=""
    while IFS=$'\t' read -r name command; do
        for prefix in "${only[@]}"; do
            if [[ "$name" == "$prefix"* ]]; then
                selected+="$name"$'\t'"$command"$'\n'
                break
            fi
        done
    done <<< "$steps"
    steps="${selected%$'\n'}"
    if [ -z "$steps" ]; then
        echo "gpu_check.sh: no step starts with: ${only[*]}" >&2
        exit 2
    fi
fi
if [ "$dry_run" = 1 ]; then
    echo "$steps"
    exit 0
fi

mkdir -p "$LOGS"
names=()
results=()
seconds=()
details=()
while IFS=$'\t' read -r name command; do
    log="$LOGS/$name.log"
    echo "==> $name: $command"
    begin=$(date +%s)
    timeout --kill-after=30 "$STEP_TIMEOUT" bash -c "$command" > "$log" 2>&1 < /dev/null
    status=$?
    end=$(date +%s)
    detail=$(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | tr -s ' =' ' ' | cut -c1-90)
    case $status in
        0) result=PASS ;;
        124|137) result=TIMEOUT ;;
        *) result=FAIL ;;
    esac
    echo "    $result in $((end - begin)) s: $detail (log: $log)"
    names+=("$name")
    results+=("$result")
    seconds+=("$((end - begin))")
    details+=("$detail")
done <<< "$steps"

echo
printf '%-24s %-8s %8s  %s\n' step result seconds detail
printf '%-24s %-8s %8s  %s\n' "----" "------" "-------" "------"
failed=0
for i in "${!names[@]}"; do
    printf '%-24s %-8s %8s  %s\n' "${names[$i]}" "${results[$i]}" "${seconds[$i]}" "${details[$i]}"
    [ "${results[$i]}" = PASS ] || failed=$((failed + 1))
done
echo
if [ "$failed" -gt 0 ]; then
    echo "gpu check: $failed of ${#names[@]} steps failed (logs in $LOGS/)"
    exit 1
fi
echo "gpu check: all ${#names[@]} steps passed (logs in $LOGS/)"
