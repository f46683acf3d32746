#!/usr/bin/env bash
# Issue 16, item 4: the FoX op as torch.library custom ops inside a compiled block (one graph
# a block instead of five). Its GPU tests (Inductor, bf16 autocast, against the eager block),
# the host wait of a one-row step (diag_train_host.py), then bench train of the compiled FoX Pro
# with ACP, fresh weights, one row a forward, this tree against the sources in $OLD_SRC
# alternating (gpu_train_ab_fresh.sh).
# Usage: git archive <commit> src | tar -x -C runs/old && \
#   OLD_SRC=runs/old/src bash scripts/gpu.sh bash scripts/gpu_issue16_custom_op.sh  (carry runs/old, .whl)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-custom-op}"
mkdir -p "$OUT"
timeout 150 python3 -m pytest -q -s -m gpu tests/ops/test_forgetting_library.py -p no:cacheprovider --tb=short 2>&1 \
    | grep -E "^(E |FAILED|ERROR)|passed|failed|rel err" | head -n 20
timeout 120 python3 scripts/diag_train_host.py --out "$OUT/host-fox-pro-acp.txt" 2>&1 | grep -E "^==|step wall|^op "
OUT="$OUT" bash scripts/gpu_train_ab_fresh.sh
