#!/usr/bin/env bash
# Issue 16, twenty-first session: ACP's efficiency by head set (global heads, which ACP prunes
# nowhere, against local ones), the kernels alone (scripts/diag_acp_heads.py).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_s21_heads.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s21-heads}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
timeout 500 python3 scripts/diag_acp_heads.py --shapes 4096x128 16384x128 4096x64 16384x64 \
    --fwd-variants '{"BM": 128, "BN": 64, "num_warps": 8, "TMA": "host", "PAIRS": true, "ROW_BIAS": true}' \
    --out "$OUT/$tag-acp-heads.json" 2>&1 | grep -v Warning
