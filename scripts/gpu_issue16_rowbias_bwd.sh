#!/usr/bin/env bash
# Issue 16, seventeenth session: the backward's two kernels with ROW_BIAS (the query's c_i
# joins its lse: one multiply-add and one add a pair), in one kernel or both, with the dQ
# kernel's PAIRS flipped too (the forward's ROW_BIAS paid only with PAIRS), twice (noise).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_rowbias_bwd.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-rowbias-bwd}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null || true
for rep in 1 2; do
    timeout 250 python3 scripts/tune_fox_bwd.py --no-fused --out "$OUT/bwd-rowbias-$rep.json" --variants \
        '{"kv": {"ROW_BIAS": true}, "q": {"ROW_BIAS": true}}' '{"kv": {"ROW_BIAS": true}}' \
        '{"q": {"ROW_BIAS": true}}' '{"kv": {"ROW_BIAS": true}, "q": {"ROW_BIAS": true, "PAIRS": true}}' \
        '{"kv": {"ROW_BIAS": true}, "q": {"ROW_BIAS": true, "PAIRS": false}}' 2>&1 | grep -v Warning | tail -n 4
done
