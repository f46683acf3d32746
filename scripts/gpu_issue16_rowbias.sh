#!/usr/bin/env bash
# Issue 16, seventeenth session: the forward's logits without the query's own c_i
# (ROW_BIAS: one multiply-add a pair for scale and bias; the lse adds c_i back), against the
# default tables, dense and ACP, D 64 and 128; with PAIRS flipped too (the bias loads). Then
# where one op call's time goes now (scripts/profile_fox_op.py), for ACP's fixed costs.
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_rowbias.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-rowbias}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null || true
for rep in 1 2; do
    timeout 200 python3 scripts/tune_fox_fwd.py --shapes 4096x64 16384x64 4096x128 16384x128 \
        --variants '{"ROW_BIAS": true}' '{"ROW_BIAS": true, "PAIRS": true}' '{"ROW_BIAS": true, "PAIRS": false}' \
        --out "$OUT/fwd-rowbias-$rep.json" 2>&1 | grep -v Warning | tail -n 9
done
timeout 200 python3 scripts/profile_fox_op.py --shapes 4096x64 8192x64 4096x128 8192x128 \
    --out "$OUT/fox-op-profile.json" 2>&1 | grep -v Warning | tail -n 80
