#!/usr/bin/env bash
# Issue 16, twenty-first session: ROUTE in the backward (dK/dV by key head, dQ by query head):
# its GPU tests, then the kernels by head set with ROUTE as a backward variant.
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_s21_bwd.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s21-bwd}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
timeout 200 python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py -p no:cacheprovider --tb=short \
    -k "routed_forward_gpu and loops" 2>&1 | grep -E "^(E |FAILED|ERROR)|passed|failed" | head -n 20
timeout 330 python3 scripts/diag_acp_heads.py --shapes 4096x128 8192x128 16384x128 4096x64 8192x64 16384x64 \
    --bwd-variants '{"kv": {"ROUTE": 1}}' --out "$OUT/$tag-acp-route-bwd.json" 2>&1 \
    | grep -E "all .*(acp|dense)|bwd:"
