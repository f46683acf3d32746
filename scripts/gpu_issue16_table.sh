#!/usr/bin/env bash
# Issue 16, sixteenth session: the forward's pipeline depth and descriptor mode per GPU, each
# option keeping the default config's other switches (tune_fox_fwd.py --keep-switches); with
# AB=1 first this tree's kernels against ab_old/'s (scripts/ab_fox_kernels.py --prepare REV;
# carry ab_old).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_table.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-table}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
if [[ "${AB:-0}" == 1 ]]; then
    timeout 300 python3 scripts/ab_fox_kernels.py --shapes 4096x64 16384x64 4096x128 16384x128 \
        --out "$OUT/$tag-ab-masks.json" 2>&1 | grep -v Warning | tail -n 9
fi
timeout 200 python3 scripts/tune_fox_fwd.py --shapes 4096x64 16384x64 --block-m 128 --block-n 64 --warps 4 \
    --stages 2 3 4 --tma 1 2 --keep-switches --out "$OUT/$tag-fwd-d64.json" 2>&1 | grep -v Warning | tail -n 5
timeout 200 python3 scripts/tune_fox_fwd.py --shapes 4096x128 16384x128 --block-m 128 --block-n 128 --warps 8 \
    --stages 2 3 4 --tma 1 2 --keep-switches --out "$OUT/$tag-fwd-d128.json" 2>&1 | grep -v Warning | tail -n 5
