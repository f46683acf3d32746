#!/usr/bin/env bash
# Issue 16, the FoX backward: the dK/dV kernel spills at its default options when compiled
# for sm_90 (scripts/kernel_resources.py --bwd-sweep: 600 B per thread at D 64, 1.6 KB at
# D 128); time the spill-free options against the default beside SDPA's default backend
# (scripts/tune_fox_bwd.py).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_bwd.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-bwd}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null || true
timeout 400 python3 scripts/tune_fox_bwd.py --out "$OUT/fox-bwd.json" 2>&1 | grep -v -i warn | tail -n 14
