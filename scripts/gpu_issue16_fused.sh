#!/usr/bin/env bash
# Issue 16, the backward: one kernel with dQ through atomics (FUSE_DQ) against the two
# kernels: its GPU tests against the float64 oracle, then scripts/tune_fox_bwd.py (the
# fused options beside the default, SDPA's default backend in the same run).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_fused.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-fused}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null || true
timeout 100 python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py -k atomics --tb=short \
    -p no:cacheprovider 2>&1 | grep -E "^(E |FAILED|ERROR)|passed|failed" | head -n 20
timeout 240 python3 scripts/tune_fox_bwd.py --out "$OUT/fox-bwd-fused.json" 2>&1 | grep -v -i warn | tail -n 14
# issue 15: the HF prefills again, window and H2O too, each 2 x 7 times (scripts/diag_prefill_hf.py)
timeout 80 python3 scripts/diag_prefill_hf.py --repeats 7 --no-profile --out "$OUT/prefill-diag-timings.json" 2>&1 | grep -E "median"
