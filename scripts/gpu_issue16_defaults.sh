#!/usr/bin/env bash
# Issue 16, the kernels at their tuning tables (first: fe8868e, TMA loads for D 64 and D 128 dense, 128 x 128
# tiles at D 128 dense): the GPU tests of the FoX kernels at their defaults, then
# lapse bench attention at D 64 and D 128, T 4k-16k, beside SDPA's default backend.
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_defaults.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-defaults}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null || true
timeout 300 python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py tests/ops/test_forgetting_cached.py \
    --tb=short -p no:cacheprovider 2>&1 | grep -E "^(E |FAILED|ERROR)|passed|failed" | head -n 20
for d in 64 128; do
    timeout 140 python3 -m lapse.cli bench attention --seq-lens 4096 8192 16384 --tokens 32768 --heads 24 \
        --head-dim "$d" --providers sdpa-default lapse lapse-acp --out-dir "$OUT/attention-d$d" 2>&1 \
        | grep -E "^\| (sdpa|lapse)|^## |bound delta" | head -n 20
done
