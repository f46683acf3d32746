#!/usr/bin/env bash
# Issue 16, twentieth session, at the final tables (D 128's backward keeps dS): the op's GPU
# tests, then lapse bench attention at D 128 (and with 24 query heads over 6) and, for the
# record, D 64 (its tables unchanged since 4c8c752). Carry .whl.
# Usage, from the repo root: COMMIT=<this tree> bash scripts/gpu.sh bash scripts/gpu_issue16_s20_final.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s20-final}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
commit=(); [[ -n "${COMMIT:-}" ]] && commit=(--commit "$COMMIT")
timeout 330 python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py tests/ops/test_forgetting_library.py \
    tests/ops/test_forgetting_cached.py -p no:cacheprovider --tb=short \
    -k "test_triton_gpu or inductor or cached or backward_through or kept_ds or long_context" 2>&1 \
    | grep -E "^(E |FAILED|ERROR)|passed|failed" | head -n 20
for kv in 24 6; do
    timeout 120 python3 -m lapse.cli bench attention --seq-lens 4096 8192 16384 --tokens 32768 --heads 24 \
        --kv-heads "$kv" --head-dim 128 --providers sdpa-default lapse lapse-acp \
        --out-dir "$OUT/$tag-attention-d128-kv$kv" "${commit[@]}" 2>&1 | grep -E "^\| (sdpa|lapse)|^## " | head -n 20
done
