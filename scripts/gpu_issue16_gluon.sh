#!/usr/bin/env bash
# Issue 16: the Gluon forward (ops/forgetting/gluon_fwd.py) on the GPU: its tests against
# the float64 oracle, then its options timed beside the Triton kernel's default and SDPA's
# default backend (scripts/tune_fox_fwd.py --only-gluon). Run: bash scripts/gpu.sh bash scripts/gpu_issue16_gluon.sh
set -uo pipefail
OUT="${OUT:-/tmp}"
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pytest -m gpu -q tests/ops/test_forgetting_triton.py -k gluon 2>&1 | tail -15 | tee "$OUT/gluon-tests.txt"
python3 scripts/tune_fox_fwd.py --only-gluon ${TUNE_ARGS:-} --out "$OUT/gluon-fwd.json" 2>&1 | tail -12
