#!/usr/bin/env bash
# Issue 16, eighteenth session, at the final tables: the GPU tests of the default configs and
# of the flipped options, then lapse bench attention at D 64 and 128. Carry .whl (the CLI's tyro).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_s18_final.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s18-final}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
timeout 300 python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py -p no:cacheprovider --tb=short \
    -k "test_triton_gpu or other_load or backward_through" 2>&1 | grep -E "^(E |FAILED|ERROR)|passed|failed" | head -n 20
for d in 64 128; do
    timeout 120 python3 -m lapse.cli bench attention --seq-lens 4096 8192 16384 --tokens 32768 --heads 24 \
        --head-dim "$d" --providers sdpa-default lapse lapse-acp --out-dir "$OUT/$tag-attention-d$d" 2>&1 \
        | grep -E "^\| (sdpa|lapse)|^## " | head -n 20
done
