#!/usr/bin/env bash
# Issue 16, fifteenth session: the op's fixed costs. GPU tests of the FoX kernels (each query's
# rows made by one kernel; the gate's scans chunked), then where one call's time goes
# (profile_fox_op.py), the backward with its rows made by the dQ kernel or a launch of their
# own (tune_fox_bwd.py), and the ACP forward's tiles at D 64 (tune_fox_fwd.py).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_rows.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-rows}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null || true
timeout 300 python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py tests/ops/test_forgetting_cached.py \
    --tb=short -p no:cacheprovider 2>&1 | grep -E "^(E |FAILED|ERROR)|passed|failed" | head -n 20
timeout 60 python3 -m pytest -q tests/ops/test_forgetting_triton.py -k "gate_scans or fused_acp" --tb=short \
    -p no:cacheprovider 2>&1 | tail -n 2
timeout 120 python3 scripts/profile_fox_op.py --out "$OUT/fox-op-profile.json" 2>&1 | grep -E "^## "
timeout 200 python3 scripts/tune_fox_bwd.py --no-fused --out "$OUT/fox-bwd-rows.json" 2>&1 | tail -n 6
timeout 150 python3 scripts/tune_fox_fwd.py --shapes 4096x64 8192x64 16384x64 --block-m 64 128 --block-n 64 \
    --warps 4 --stages 2 3 4 --tma 1 --out "$OUT/fox-fwd-acp-tiles.json" 2>&1 | tail -n 8
