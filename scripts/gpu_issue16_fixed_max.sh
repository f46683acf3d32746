#!/usr/bin/env bash
# Issue 16, seventeenth session: the forward with FIXED_MAX (the diagonal keys' maximum as
# every other key's reference: no online maximum, no rescaling; a tile whose weights overflow
# is done again the usual way) against the tables' default, dense and ACP, D 64 and 128
# (ACP at D 64 also capped at 168 registers: three programs a multiprocessor), then its GPU
# tests. Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_fixed_max.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-fixed-max}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null || true
timeout 100 python3 scripts/tune_fox_fwd.py --shapes 4096x64 16384x64 4096x128 16384x128 \
    --variants '{"FIXED_MAX": true}' '{"FIXED_MAX": true, "maxnreg": 168}' \
    --out "$OUT/fwd-fixed-max.json" 2>&1 | grep -v Warning | tail -n 9
timeout 150 python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py -k "fixed_maximum_gpu" \
    -p no:cacheprovider --tb=short 2>&1 | grep -E "^(E |FAILED|ERROR)|passed|failed" | head -n 20
