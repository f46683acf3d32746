#!/usr/bin/env bash
# Issue 16, twenty-ninth session on: FoX on FlashAttention-4's Hopper forward (scripts/fa4_fox.py,
# with lapse's backward on FlashAttention-4's kernel): its errors against float64 beside lapse's,
# then forward and fwd+bwd times beside FlashAttention-4, SDPA's default and lapse (the thirtieth
# session's query-sum variants ran from scripts/gpu_issue16_s30_rows.sh at a10801d).
# FlashAttention-4 as in scripts/gpu_issue16_s28_fa4.sh (scripts/fa4_env.sh): call 1 carries .fa4a
# (`mkdir -p /tmp/fa4parts && cp .fa4a/part.* /tmp/fa4parts/`), call 2 at once carries .fa4b:
#   bash scripts/gpu_issue16_s29_fa4_fox.sh        # options: DIMS, SEQ_LENS
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s29}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
source scripts/fa4_env.sh || exit 1
timeout "${FOX_TIMEOUT:-500}" python3 scripts/fa4_fox.py --out "$OUT/fa4-fox.json" \
    ${DIMS:+--dims $DIMS} ${SEQ_LENS:+--seq-lens $SEQ_LENS} 2>&1 | grep -v -E "UserWarning|generate_mlir_function_types|_warn_once" | tail -n 40
