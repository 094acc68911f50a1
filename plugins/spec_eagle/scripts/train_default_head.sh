#!/usr/bin/env bash
# Train the EAGLE draft head shipped for the built-in default model (SmolLM2-135M-Instruct)
# and write it to plugserve_spec_eagle/weights/smollm2-135m-instruct/. See ../TRAINING.md.
#
# CPU, one torch thread, seed 0: the same machine gives the same weights. Takes about an
# hour (generation ~half of it). The log goes to stdout; the run's numbers to
# weights/smollm2-135m-instruct/train_report.json.
#
# The loss weights are not CLI flags of `python -m plugserve_spec_eagle.train`, so this calls
# train_head() directly; the CLI equivalent of everything else is
#   python -m plugserve_spec_eagle.train --prompts plugserve_spec_eagle/data/train_prompts.jsonl \
#     --out plugserve_spec_eagle/weights/smollm2-135m-instruct --seed 0 --max-new-tokens 320 \
#     --draft-vocab 8192 --epochs 12 --lr 1e-3 --batch-size 2 --chat --no-ignore-eos \
#     --save-dtype bfloat16 --held-out 0.05 --device cpu --threads 1
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"   # plugins/spec_eagle
ROOT="$(cd "$HERE/../.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
cd "$HERE"
exec "$PYTHON" - <<'PY'
from plugserve_spec_eagle.train import train_head
from plugserve_spec_eagle.train_data import read_prompts

report = train_head(
    None,  # the built-in default model, SmolLM2-135M-Instruct
    read_prompts("plugserve_spec_eagle/data/train_prompts.jsonl"),
    "plugserve_spec_eagle/weights/smollm2-135m-instruct",
    seed=0,
    max_new_tokens=320,
    draft_vocab_size=8192,
    epochs=12,
    lr=1e-3,
    batch_size=2,
    chat=True,
    ignore_eos=False,
    dtype_to_save="bfloat16",
    held_out_fraction=0.05,
    feature_weight=1.0,
    token_weight=1.0,
    device="cpu",
    threads=1,
    log=lambda m: print(m, flush=True),
)
print(report.summary(), flush=True)
PY
