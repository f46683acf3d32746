#!/usr/bin/env bash
# Issue 16, sixteenth session: the ACP forward's tiles, warps, stages and descriptors at D 64
# and 128 (tune_fox_fwd.py --modes acp --keep-switches), since its edges lost their per-pair
# mask; then this tree's kernels against ab_old/'s (scripts/ab_fox_kernels.py; carry ab_old).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_acp_fwd.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-acp-fwd}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
timeout 200 python3 scripts/tune_fox_fwd.py --modes acp --shapes 4096x128 16384x128 --block-m 64 128 --block-n 64 \
    --warps 4 8 --stages 2 3 4 --tma 0 2 --keep-switches --out "$OUT/$tag-acp-fwd-d128.json" 2>&1 \
    | grep -v Warning | tail -n 3
timeout 150 python3 scripts/tune_fox_fwd.py --modes acp --shapes 4096x64 16384x64 --block-m 64 128 --block-n 64 \
    --warps 4 8 --stages 3 4 --tma 1 2 --keep-switches --out "$OUT/$tag-acp-fwd-d64.json" 2>&1 \
    | grep -v Warning | tail -n 3
timeout 200 python3 scripts/ab_fox_kernels.py --shapes 4096x64 8192x64 4096x128 8192x128 \
    --out "$OUT/$tag-ab-final.json" 2>&1 | grep -v Warning | tail -n 9
