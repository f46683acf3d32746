#!/usr/bin/env bash
# Issue 16, twenty-first session: lapse bench attention at D 64 and D 128 (the tables with ROUTE).
# Usage, from the repo root: COMMIT=<this tree> bash scripts/gpu.sh bash scripts/gpu_issue16_s21_bench.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s21-bench}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
commit=(); [[ -n "${COMMIT:-}" ]] && commit=(--commit "$COMMIT")
for d in 64 128; do
    timeout 250 python3 -m lapse.cli bench attention --seq-lens 4096 8192 16384 --tokens 32768 --heads 24 \
        --head-dim "$d" --providers sdpa-default lapse lapse-acp \
        --out-dir "$OUT/$tag-attention-d$d" "${commit[@]}" 2>&1 | grep -E "^\| (sdpa|lapse)|^## " | head -n 20
done
