#!/usr/bin/env bash
# Issue 16, eighteenth session: the backward's tensor descriptors as defaults (TMA="host" in
# both kernels without grouped-query heads, the dQ kernel at D 64 capped at 168 registers).
# The GPU tests of the default configs (test_triton_gpu: forward and backward against the
# float64 reference at awkward shapes; long contexts; the descriptors against pointer loads),
# then lapse bench attention at D 64 and 128. Carry .whl (the CLI's tyro).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_s18.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s18}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
timeout 300 python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py -p no:cacheprovider --tb=short \
    -k "test_triton_gpu or long_context or backward_through" 2>&1 | grep -E "^(E |FAILED|ERROR)|passed|failed" | head -n 20
for d in 64 128; do
    timeout 120 python3 -m lapse.cli bench attention --seq-lens 4096 8192 16384 --tokens 32768 --heads 24 \
        --head-dim "$d" --providers sdpa-default lapse lapse-acp --out-dir "$OUT/$tag-attention-d$d" 2>&1 \
        | grep -E "^\| (sdpa|lapse)|^## |bound delta" | head -n 20
done
