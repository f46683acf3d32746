#!/usr/bin/env bash
# Tenth session, first call: does pipelining every load of a loop pay? (1) the FoX
# forward/backward kernels with LOOP_STAGES 0 / num_stages / num_stages + 1 against SDPA's
# default backend (issue 16); (2) the CASTLE decode kernel's loop pipeline, swept with its
# tiles (issue 13); (3) the CASTLE decode GPU tests; (4) the decode step of CASTLE,
# CASTLE-SWL and the Transformer at 125M, 8 x 4096, with the new default (issue 13's target).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_session10.sh COMMIT
set -uo pipefail
export PYTHONUNBUFFERED=1
COMMIT="${1:-unknown}"
OUT="${OUT:-runs/session10}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null || true
timeout 200 python3 scripts/tune_fox_pipeline.py --out "$OUT/fox-pipeline.json" 2>&1 | grep -v -i warn | tail -n 22
timeout 150 python3 scripts/tune_castle_decode.py --shapes 8x4096 1x4096 --block-n 32 64 128 --warps 4 8 \
    --out "$OUT/castle-decode-pipeline.json" 2>&1 | grep -v -i warn | tail -n 4
timeout 120 python3 -m pytest -q -m gpu tests/ops/test_castle_decode_gpu.py tests/ops/test_castle_paged_gpu.py \
    --tb=short 2>&1 | grep -E "^(E |FAILED|[0-9]+ (passed|failed))|Error" | head -n 20
timeout 150 python3 -m lapse.cli bench decode --archs castle castle-swl transformer-llama --workloads 8x4096 \
    --providers lapse-compile --commit "$COMMIT" --out-dir "$OUT/decode" 2>&1 | grep -v -i warn | tail -n 8
