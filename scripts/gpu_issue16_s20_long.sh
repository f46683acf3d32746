#!/usr/bin/env bash
# Issue 16, twentieth session: D 128's ACP forward with 128-row tiles from LONG_ACP_KEYS keys on.
# Its GPU tests, the forward against the 64-row table (tune_fox_fwd's default: no key length),
# then lapse bench attention at D 128.
# Usage, from the repo root: COMMIT=<this tree> bash scripts/gpu.sh bash scripts/gpu_issue16_s20_long.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s20-long}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
commit=(); [[ -n "${COMMIT:-}" ]] && commit=(--commit "$COMMIT")
timeout 240 python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py -p no:cacheprovider --tb=short \
    -k "long_acp_tiles_gpu" 2>&1 | grep -E "^(E |FAILED|ERROR)|passed|failed" | head -n 20
timeout 120 python3 scripts/tune_fox_fwd.py --shapes 4096x128 8192x128 16384x128 --modes acp \
    --variants '{"BM": 128, "BN": 64, "num_warps": 8, "TMA": "host", "ROW_BIAS": true, "PAIRS": true}' \
    --out "$OUT/$tag-fwd-acp-d128-long.json" 2>&1 | tail -n 4
timeout 150 python3 -m lapse.cli bench attention --seq-lens 4096 8192 16384 --tokens 32768 --heads 24 \
    --head-dim 128 --providers sdpa-default lapse lapse-acp --out-dir "$OUT/$tag-attention-d128" "${commit[@]}" \
    2>&1 | grep -E "^\| (sdpa|lapse)|^## " | head -n 20
