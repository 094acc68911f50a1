#!/usr/bin/env bash
# Train the EAGLE draft head shipped for the built-in default model (SmolLM2-135M-Instruct)
# and write it to plugserve_spec_eagle/weights/smollm2-135m-instruct/. See ../TRAINING.md.
#
# CPU, one torch thread, seed 0: the same machine gives the same weights. Takes about an
# hour (generation ~half of it). The log goes to stdout; the run's numbers to
# weights/smollm2-135m-instruct/train_report.json.
#
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"   # plugins/spec_eagle
ROOT="$(cd "$HERE/../.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
cd "$HERE"
exec "$PYTHON" -m plugserve_spec_eagle.train \
    --prompts plugserve_spec_eagle/data/train_prompts.jsonl \
    --out plugserve_spec_eagle/weights/smollm2-135m-instruct \
    --seed 0 --max-new-tokens 320 --draft-vocab 8192 --epochs 12 --lr 1e-3 --batch-size 2 \
    --feature-weight 1.0 --token-weight 1.0 --chat --no-ignore-eos --save-dtype bfloat16 \
    --held-out 0.05 --device cpu --threads 1
