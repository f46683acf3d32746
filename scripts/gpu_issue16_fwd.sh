#!/usr/bin/env bash
# Issue 16, the FoX forward kernel: the tensor-descriptor loads (TMA=True, opt-in) equal the
# pointer loads on the GPU, then the launch options (tiles incl. 128-key tiles for dense,
# warps, stages, TMA) timed beside SDPA's default backend (scripts/tune_fox_fwd.py), then
# lapse bench attention with ACP (the fused bound).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_fwd.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-fwd}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null || true
timeout 120 python3 -m pytest -q tests/ops/test_forgetting_triton.py -k "descriptors or fused_acp" --tb=short 2>&1 \
    | grep -E "^(E |FAILED|[0-9]+ (passed|failed))|Error" | head -n 20
timeout 330 python3 scripts/tune_fox_fwd.py --out "$OUT/fox-fwd.json" 2>&1 | grep -v -i warn | tail -n 14
# ACP's bound delta through the fused kernels (8b33064): 0.503 ms, 34.5% of the ACP forward at
# 8k before (the bench's own line "bound delta")
timeout 120 python3 -m lapse.cli bench attention --seq-lens 8192 16384 --tokens 32768 --heads 24 --head-dim 64 \
    --providers sdpa-default lapse lapse-acp --out-dir "$OUT/attention-d64" 2>&1 | grep -v -i warn | tail -n 14
