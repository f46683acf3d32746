#!/usr/bin/env bash
# Issue 16, thirtieth session: the FoX backward on FlashAttention-4's Hopper kernel with each
# query's sum of dS made by a transposing warp reduction (scripts/fa4_fox.py, rows="t"), and the
# hybrid of lapse's forward with that backward: errors against float64, then times beside
# FlashAttention-4, SDPA's default and lapse. FlashAttention-4 as in scripts/gpu_issue16_s28_fa4.sh:
# call 1 carries .fa4a (`mkdir -p /tmp/fa4parts && cp .fa4a/part.* /tmp/fa4parts/`), call 2 at
# once carries .fa4b:
#   bash scripts/gpu_issue16_s30_rows.sh        # options: DIMS, SEQ_LENS
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s30}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
source scripts/fa4_env.sh || exit 1
timeout "${FOX_TIMEOUT:-540}" python3 scripts/fa4_fox.py --out "$OUT/fa4-fox-rows.json" \
    ${DIMS:+--dims $DIMS} ${SEQ_LENS:+--seq-lens $SEQ_LENS} 2>&1 \
    | grep -v -E "UserWarning|generate_mlir_function_types|_warn_once" | tail -n 60
