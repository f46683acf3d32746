#!/usr/bin/env bash
# Issue 16, item 4: bench train with each block replayed as a CUDA graph (-cudagraphs:
# torch.compile's reduce-overhead mode; the FoX op is inside the block's graph since the
# custom ops), beside the compiled blocks, FoX Pro + ACP and the Transformer Pro, fresh
# weights, one row a forward. Its GPU test first (the same losses with and without the
# graphs). Carry .whl. Usage: bash scripts/gpu.sh bash scripts/gpu_issue16_cudagraphs_train.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-cudagraphs-train}"
mkdir -p "$OUT"
timeout 150 python3 -m pytest -q -s -m gpu tests/bench/test_training.py -p no:cacheprovider --tb=long 2>&1 | tee "$OUT/pytest.log" \
    | grep -E "^(E |FAILED|ERROR)|passed|failed|losses" | head -n 20
timeout 380 python3 -m lapse.cli bench train --preset 125m --arch fox-pro --seq-len 16384 \
    --variants acp-compile acp-cudagraphs transformer-compile transformer-cudagraphs --steps 6 --warmup 2 \
    --out-dir "$OUT/train-125m-16k" 2>&1 | grep -E "^\| |Error|error" | head -n 12
