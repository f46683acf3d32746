#!/usr/bin/env bash
# Issue 16, seventeenth session, at the final tables (ROW_BIAS): this tree's kernels against
# ab_old/'s (scripts/ab_fox_kernels.py --prepare REV first), then lapse bench attention at D 64
# and 128 (carry ab_old and .whl, for the CLI). The GPU tests take a call of their own: on a
# fresh machine they compile for about four minutes (pytest -m gpu tests/ops/test_forgetting_triton.py).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_s17.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s17}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
timeout 200 python3 scripts/ab_fox_kernels.py --out "$OUT/$tag-ab-s17.json" 2>&1 | grep -v Warning | tail -n 13
for d in 64 128; do
    timeout 120 python3 -m lapse.cli bench attention --seq-lens 4096 8192 16384 --tokens 32768 --heads 24 \
        --head-dim "$d" --providers sdpa-default lapse lapse-acp --out-dir "$OUT/$tag-attention-d$d" 2>&1 \
        | grep -E "^\| (sdpa|lapse)|^## |bound delta" | head -n 20
done
