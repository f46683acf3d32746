#!/usr/bin/env bash
# Issue 16, item 4: does the compiled 125M training step wait on the host? Step wall time
# against GPU busy time, FoX Pro + ACP at 1 and 4 rows a forward and the Transformer Pro, the
# op's host time and its hottest Python functions; then lapse bench train at 4 rows a forward.
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_host.sh (carry .whl)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-host}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null || true
timeout 150 python3 scripts/diag_train_host.py --out "$OUT/host-fox-pro-acp.txt" 2>&1 | grep -v -i warn | head -n 45
timeout 100 python3 scripts/diag_train_host.py --arch transformer-pro --out "$OUT/host-transformer-pro.txt" 2>&1 \
    | grep -E "^==|step wall"
timeout 240 python3 -m lapse.cli bench train --preset 125m --arch fox-pro --seq-len 16384 --micro-batch-size 4 \
    --variants acp-compile transformer-compile --steps 6 --warmup 2 --out-dir "$OUT/train-125m-16k-micro4" 2>&1 \
    | grep -E "^\| |MFU"
