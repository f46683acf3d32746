#!/usr/bin/env bash
# Issue 16, twenty-fourth session: where test_other_load_options_gpu stops (scripts/diag_flipped_hang.py),
# each scenario in its own process with a time limit: the two cases as they are, then the D 64 ACP
# case with the forward's previous ACP options (168 registers, 3 stages), with the dK/dV kernel's
# previous 32-query steps, and without the flipped options.
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_s24_hang.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_LAUNCH_BLOCKING=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
run() { echo "== $*"; timeout 70 python3 scripts/diag_flipped_hang.py "$@" 2>&1 | grep -v "^  File.*site-packages" | tail -n 14; }
run --case 1
run --case 2
run --case 1 --fwd '{"maxnreg": 168, "num_stages": 3}'
run --case 1 --kv '{"BM": 32}'
run --case 1 --no-flip
run --case 0
