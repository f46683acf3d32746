#!/usr/bin/env bash
# Issue 16, twenty-third session: the bench with ACP's bound from QK-norm (--acp-bound qk-norm:
# what a FoX Pro layer passes, no pass over q and k) and --graph-times, D 64 and D 128, to set
# beside the same bench with --acp-bound auto (gpu_issue16_s23_first.sh).
# Usage, from the repo root: COMMIT=<tree> bash scripts/gpu.sh bash scripts/gpu_issue16_s23_qknorm.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s23-qknorm}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
commit=(); [[ -n "${COMMIT:-}" ]] && commit=(--commit "$COMMIT")
for d in ${BENCH_DIMS:-64 128}; do
    timeout 280 python3 -m lapse.cli bench attention --seq-lens 4096 8192 16384 --tokens 32768 --heads 24 \
        --head-dim "$d" --providers sdpa-default lapse lapse-acp --graph-times --acp-bound qk-norm \
        --out-dir "$OUT/$tag-attention-d$d-qknorm" "${commit[@]}" 2>&1 | grep -E "^\| (sdpa|lapse)|^## |CUDA graph" | head -n 40
done
