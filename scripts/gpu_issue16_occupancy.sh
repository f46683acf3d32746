#!/usr/bin/env bash
# Issue 16, sixteenth session: more programs a multiprocessor. The forward at D 64 with
# 64-row tiles (128 registers a thread: four programs of 4 warps a multiprocessor, against
# two with 128-row tiles), and the dQ kernel capped at 200 or 168 registers (three programs
# instead of two), dense and with ACP (scripts/diag_acp_window.py: windows of 1, 4, 16 blocks).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_occupancy.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-occupancy}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null || true
timeout 240 python3 scripts/tune_fox_fwd.py --shapes 4096x64 16384x64 --block-m 64 128 --block-n 64 --warps 4 \
    --stages 2 3 4 --tma 0 1 --out "$OUT/fwd-bm64.json" 2>&1 | grep -v Warning | tail -n 6
timeout 300 python3 scripts/diag_acp_window.py --shapes 4096x64 16384x64 --windows 1 4 16 \
    --fwd-variants '{"BM": 64, "TMA": true}' '{"BM": 64, "TMA": true, "num_stages": 3}' \
    --bwd-variants '{"q": {"maxnreg": 200}}' '{"q": {"maxnreg": 168}}' \
    --out "$OUT/acp-window-occupancy.json" 2>&1 | grep -E "^  |efficiency|t = " | head -n 60
