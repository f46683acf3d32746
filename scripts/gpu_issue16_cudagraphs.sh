#!/usr/bin/env bash
# Issue 16, item 4: with the FoX op inside each compiled block's graph, can the blocks take CUDA
# graphs (torch.compile mode reduce-overhead) and stop the one-row step waiting on the host?
# diag_train_host.py at the default mode and at reduce-overhead.
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_cudagraphs.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-cudagraphs}"
mkdir -p "$OUT"
timeout 120 python3 scripts/diag_train_host.py --out "$OUT/host-default.txt" 2>&1 | grep -E "^==|step wall"
timeout 200 python3 scripts/diag_train_host.py --mode reduce-overhead --out "$OUT/host-reduce-overhead.txt" 2>&1 \
    | grep -vi warn | grep -E "^==|step wall|Error|error" | head -n 12
