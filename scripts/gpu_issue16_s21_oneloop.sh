#!/usr/bin/env bash
# Issue 16, twenty-first session: ONE_LOOP (every kept key in one pipelined loop) in the ACP
# forward, with and without the 64-row tiles, by head set (diag_acp_heads.py); its GPU tests.
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_s21_oneloop.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s21-oneloop}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
timeout 300 python3 scripts/diag_acp_heads.py --shapes 4096x128 16384x128 4096x64 16384x64 \
    --fwd-variants '{"ONE_LOOP": true}' '{"ONE_LOOP": true, "num_stages": 2}' \
    '{"BM": 64, "BN": 64, "num_warps": 4, "num_stages": 3, "TMA": false, "PAIRS": false, "ROW_BIAS": false, "LOOPS": 3}' \
    '{"BM": 64, "BN": 64, "num_warps": 4, "num_stages": 3, "TMA": false, "PAIRS": false, "ROW_BIAS": false, "ONE_LOOP": true}' \
    --out "$OUT/$tag-acp-oneloop.json" 2>&1 | grep -E "(all|local) .*(acp|dense)|fwd:"
timeout 250 python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py -p no:cacheprovider --tb=short \
    -k "routed_forward_gpu" 2>&1 | grep -E "^(E |FAILED|ERROR)|passed|failed" | head -n 20
