#!/usr/bin/env bash
# Issue 16, seventeenth session: the fused backward with dQ added a tile at a time by the
# tensor-memory engine (FUSE_DQ="tma": cp.reduce.async.bulk), 5 matrix products a tile pair
# instead of the two kernels' 7; its GPU tests first. Then the D 64 dense forward with
# 256-row tiles and 8 warps (two warpgroups sharing each key and value tile).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_fused_tma.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-fused-tma}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null || true
timeout 150 python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py -k "bulk_adds" 2>&1 | tail -n 4
timeout 300 python3 scripts/tune_fox_bwd.py --out "$OUT/fox-bwd-fused-tma.json" 2>&1 | grep -v Warning | tail -n 10
timeout 120 python3 scripts/tune_fox_fwd.py --shapes 4096x64 16384x64 --block-m 128 256 --block-n 64 --warps 4 8 \
    --stages 2 3 --tma 1 --keep-switches --modes dense --out "$OUT/fwd-bm256.json" 2>&1 | grep -v Warning | tail -n 8
