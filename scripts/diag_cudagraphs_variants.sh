#!/usr/bin/env bash
# Which combination of -cudagraphs variants in one bench train process fails, with the
# traceback (tiny FoX Pro, T 256). Carry .whl. Usage: bash scripts/gpu.sh bash scripts/diag_cudagraphs_variants.sh
set -uo pipefail
OUT="${OUT:-runs/diag-cudagraphs}"
mkdir -p "$OUT"
i=0
for variants in "dense-cudagraphs" "acp-cudagraphs transformer-cudagraphs" "dense-cudagraphs acp-cudagraphs" \
        "acp-cudagraphs dense-cudagraphs" "dense-compile dense-cudagraphs"; do
    i=$((i + 1))
    # shellcheck disable=SC2086
    timeout 120 python3 -m lapse.cli bench train --preset tiny --arch fox-pro --seq-len 256 --batch-size 2 \
        --micro-batch-size 1 --steps 2 --warmup 1 --variants $variants --out-dir "/tmp/diag$i" > "$OUT/run$i.log" 2>&1
    echo "[$variants] rc $? $(grep -cE '^\| (dense|acp|transformer)' "$OUT/run$i.log") rows"
done
