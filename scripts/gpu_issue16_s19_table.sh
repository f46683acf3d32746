#!/usr/bin/env bash
# Issue 16, item 4's table at the nineteenth session's kernels: lapse bench train at 125M and
# 760M, T 4k and 16k, FoX Pro dense, FoX Pro + ACP and the Transformer Pro (SDPA default: cuDNN),
# each block compiled and replayed as a CUDA graph (-cudagraphs), fresh weights, 8 rows a step.
# SIZES picks the presets (default "125m 760m"); COMMIT names the tree in the results (the
# device's git HEAD is stale). Carry .whl.
# Usage: COMMIT=$(git rev-parse --short HEAD) SIZES=125m bash scripts/gpu.sh bash scripts/gpu_issue16_s19_table.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s19-table}"
mkdir -p "$OUT"
for size in ${SIZES:-125m 760m}; do
    for t in 4096 16384; do
        micro=$(( t == 4096 ? 4 : 1 ))
        echo "== $size T $t, $micro rows a forward"
        timeout 280 python3 -m lapse.cli bench train --preset "$size" --arch fox-pro --seq-len "$t" \
            --batch-size 8 --micro-batch-size "$micro" --steps 4 --warmup 2 ${COMMIT:+--commit "$COMMIT"} \
            --variants dense-cudagraphs acp-cudagraphs transformer-cudagraphs \
            --out-dir "$OUT/train-$size-$t" 2>&1 | grep -E "^\| |Error|error|memory" | head -n 8
    done
done
