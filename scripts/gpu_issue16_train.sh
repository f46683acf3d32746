#!/usr/bin/env bash
# Issue 16, item 4: lapse bench train, 125M FoX Pro at T 16384 (fresh weights, random tokens),
# compiled, with ACP and dense, beside the Transformer Pro with SDPA's default backend, in one
# process. Carry .whl. Usage: bash scripts/gpu.sh bash scripts/gpu_issue16_train.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-train}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 540 python3 -m lapse.cli bench train --preset 125m --arch fox-pro --seq-len 16384 \
    --variants acp-compile dense-compile transformer-compile --steps 8 --warmup 2 --out-dir "$OUT/train-125m-16k" 2>&1 \
    | grep -E "^\| |^## |MFU|pruned" | head -n 30
