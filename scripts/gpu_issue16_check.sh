#!/usr/bin/env bash
# Issue 16, fifteenth session: the GPU tests of the FoX kernels and the gate's scans, how ACP's
# kernel time follows its kept window (diag_acp_window.py), then lapse bench attention at D 64
# and D 128, T 4k-16k, beside SDPA's default backend (as gpu_issue16_defaults.sh).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_check.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-check}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null || true
timeout 300 python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py tests/ops/test_forgetting_cached.py \
    --tb=short -p no:cacheprovider 2>&1 | grep -E "^(E |FAILED|ERROR)|passed|failed" | head -n 20
timeout 60 python3 -m pytest -q tests/ops/test_forgetting_triton.py -k "gate_scans or fused_acp" --tb=short \
    -p no:cacheprovider 2>&1 | grep -E "^(E |FAILED|ERROR)|passed|failed" | head -n 10
timeout 120 python3 scripts/diag_acp_window.py --out "$OUT/acp-window.json" 2>&1 | tail -n 20
for d in 64 128; do
    timeout 140 python3 -m lapse.cli bench attention --seq-lens 4096 8192 16384 --tokens 32768 --heads 24 \
        --head-dim "$d" --providers sdpa-default lapse lapse-acp --out-dir "$OUT/attention-d$d" 2>&1 \
        | grep -E "^\| (sdpa|lapse)|^## |bound delta" | head -n 20
done
