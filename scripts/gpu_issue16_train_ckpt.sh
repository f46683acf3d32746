#!/usr/bin/env bash
# Issue 16, item 4, on trained weights: gpu_train_125m.sh (125M FoX Pro + ACP at T 16384 for
# TRAIN_MINUTES, then bench train of ACP and the Transformer at one row a forward), then bench
# train on the same checkpoint at four rows a forward (the step is host-bound at one: the GPU
# was busy 74% of a one-row step, scripts/diag_train_host.py). Carry .whl.
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_train_ckpt.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-train-ckpt}"
mkdir -p "$OUT"
SKIP_TINY=1 TRAIN_MINUTES="${TRAIN_MINUTES:-3}" VARIANTS="acp-compile transformer-compile" \
    bash scripts/gpu_train_125m.sh 2>&1 | grep -E "^==|^\| |train wall|pruned|tokens/s" | head -n 30
timeout 200 python3 -m lapse.cli bench train --run /tmp/r125 --micro-batch-size 4 \
    --variants acp-compile transformer-compile --steps 4 --warmup 2 --out-dir "$OUT/bench-micro4" 2>&1 \
    | grep -E "^\| "
