#!/usr/bin/env bash
# Issue 16, eighteenth session: the grouped-query backward table with descriptors and ROW_BIAS.
# The GPU tests of the default configs (test_triton_gpu has grouped-query cases), then lapse
# bench attention with 24 query heads over 6 key heads at D 64 and D 128. Carry .whl.
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_gqa_check.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-gqa-check}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
timeout 300 python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py -p no:cacheprovider --tb=short \
    -k "test_triton_gpu or backward_through" 2>&1 | grep -E "^(E |FAILED|ERROR)|passed|failed" | head -n 20
for d in 64 128; do
    timeout 120 python3 -m lapse.cli bench attention --seq-lens 4096 16384 --tokens 32768 --heads 24 --kv-heads 6 \
        --head-dim "$d" --providers sdpa-default lapse lapse-acp --out-dir "$OUT/$tag-attention-gqa-d$d" 2>&1 \
        | grep -E "^\| (sdpa|lapse)|^## " | head -n 20
done
