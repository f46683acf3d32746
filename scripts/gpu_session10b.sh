#!/usr/bin/env bash
# Tenth session, FoX kernels (issue 16): the A/B of FAST_BIAS (one operation less per pair,
# now the default for 16-bit inputs) and the loop pipeline against the base kernels, the
# GPU correctness tests of the Triton op with the new default, then `lapse bench attention`
# (the fastest SDPA backend named) at D 64, and where lapse's HF prefill spends its time (issue 15).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_session10b.sh COMMIT
set -uo pipefail
export PYTHONUNBUFFERED=1
COMMIT="${1:-unknown}"
OUT="${OUT:-runs/session10b}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null || true
timeout 220 python3 scripts/tune_fox_variants.py --out "$OUT/fox-variants.json" 2>&1 | grep -v -i warn | tail -n 26
timeout 150 python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py --tb=short 2>&1 \
    | grep -E "^(E |FAILED|[0-9]+ (passed|failed))|Error" | head -n 20
timeout 100 python3 -m lapse.cli bench attention --seq-lens 4096 8192 16384 --tokens 32768 --heads 24 \
    --head-dim 64 --providers sdpa-default lapse lapse-acp --commit "$COMMIT" \
    --out-dir "$OUT/attention-d64" 2>&1 | grep -v -i warn | tail -n 12
timeout 100 python3 scripts/diag_prefill_hf.py --out "$OUT/prefill-diag.json" 2>&1 | grep -v -i warn | tail -n 60
