#!/usr/bin/env bash
# Issue 16, sixteenth session: the kernels' masks (ACP through each row's bias, 32-bit causal
# compares): the GPU tests of the FoX kernels, then this tree's kernels against REV's in one
# process (scripts/ab_fox_kernels.py; run `python3 scripts/ab_fox_kernels.py --prepare REV`
# here first, and carry ab_old/ to the GPU).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_masks.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-masks}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null || true
timeout 300 python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py tests/ops/test_forgetting_cached.py \
    --tb=short -p no:cacheprovider 2>&1 | grep -E "^(E |FAILED|ERROR)|passed|failed" | head -n 20
timeout 400 python3 scripts/ab_fox_kernels.py ${AB_ARGS:-} --out "$OUT/ab-masks.json" 2>&1 | grep -v Warning
