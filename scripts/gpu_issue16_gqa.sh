#!/usr/bin/env bash
# Issue 16, eighteenth session: the options that the grouped-query tables leave off, timed with
# grouped-query heads (4 query heads a key head: 24 over 6 at D 64, 12 over 3 at D 128). The
# backward's tensor descriptors (TMA="host") and ROW_BIAS in both kernels; the forward
# without FIXED_MAX and without ROW_BIAS (its table takes both whatever the grouping).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_gqa.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-gqa}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null || true
timeout 280 python3 scripts/tune_fox_bwd.py --group 4 --no-fused --out "$OUT/bwd-gqa.json" --variants \
    '{"kv": {"TMA": "host"}, "q": {"TMA": "host"}}' \
    '{"kv": {"TMA": "host"}, "q": {"TMA": "host", "maxnreg": 168}}' \
    '{"kv": {"TMA": "host", "ROW_BIAS": true}, "q": {"TMA": "host", "ROW_BIAS": true}}' 2>&1 | grep -v Warning | tail -n 9
timeout 200 python3 scripts/tune_fox_fwd.py --group 4 --out "$OUT/fwd-gqa.json" --variants \
    '{"FIXED_MAX": false}' '{"FIXED_MAX": false, "ROW_BIAS": false}' 2>&1 | grep -v Warning | tail -n 9
