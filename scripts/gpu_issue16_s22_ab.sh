#!/usr/bin/env bash
# Issue 16, twenty-second session: (1) LOOPS=1 over the D 64 dense forward's table, two rounds
# (tune_fox_fwd.py, the kernel alone); (2) D 128, T 16k forward+backward with the kept dS's
# budget at its default (1/8 of the GPU's memory: dS does not fit on an 80 GB H100) and at 1/4.
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_s22_ab.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s22-ab}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
for i in 1 2; do
    (cd scripts && timeout 150 python3 tune_fox_fwd.py --shapes 4096x64 16384x64 --modes dense \
        --out "$OUT/$tag-fwd-d64-loops-$i.json" --variants '{"LOOPS": 1}' 2>&1 | grep -v -i warn | tail -n 3)
done
for frac in 0.125 0.25; do
    timeout 150 python3 -c "import sys
import lapse.ops.forgetting.triton_bwd as b
b.DS_MAX_FRACTION = float(sys.argv[1])
from lapse.cli import main
main(sys.argv[2:])" "$frac" bench attention --seq-lens 16384 --tokens 32768 --heads 24 --head-dim 128 \
        --providers sdpa-default lapse --modes fwd+bwd --out-dir "$OUT/$tag-attention-d128-16k-ds$frac" 2>&1 \
        | grep -E "^\| (sdpa|lapse)|^## " | head -n 6
done
