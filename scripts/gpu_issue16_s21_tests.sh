#!/usr/bin/env bash
# Issue 16, twenty-first session: the op's GPU tests at the tables with ROUTE, then the routed
# forward at 8k (diag_acp_heads.py, ROUTE as a variant over the table without it).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_s21_tests.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s21-tests}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
timeout 360 python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py -p no:cacheprovider --tb=short \
    -k "triton_gpu or routed or long_acp or other_load_options" 2>&1 | grep -E "^(E |FAILED|ERROR)|passed|failed" \
    | head -n 20
timeout 200 python3 scripts/diag_acp_heads.py --shapes 8192x64 8192x128 \
    --fwd-variants '{"ROUTE": 0}' '{"ROUTE": 1}' --out "$OUT/$tag-acp-route-8k.json" 2>&1 \
    | grep -E "all .*(acp|dense)|fwd:"
