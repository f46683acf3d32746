#!/usr/bin/env bash
# Issue 16, twenty-first session: the routed ACP forward (ROUTE: unpruned heads through the
# dense tiles), its GPU tests, then the kernels by head set with ROUTE as a variant.
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_s21_route.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s21-route}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
timeout 200 python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py -p no:cacheprovider --tb=short \
    -k "routed_forward_gpu" 2>&1 | grep -E "^(E |FAILED|ERROR)|passed|failed" | head -n 20
timeout 350 python3 scripts/diag_acp_heads.py --shapes 4096x128 16384x128 4096x64 16384x64 \
    --fwd-variants '{"ROUTE": 1}' '{"ROUTE": 2}' --out "$OUT/$tag-acp-route.json" 2>&1 \
    | grep -E "all .*(acp|dense)|fwd:"
