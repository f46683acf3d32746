#!/usr/bin/env bash
# Issue 16, twenty-fourth session, second check: the forward's GPU tests to the end (the first
# check's 240 s ran out), the backward's options for ACP's local heads alone (the fused kernel with
# bulk dQ adds; 64-query dK/dV steps; scripts/diag_acp_heads.py), and the bench at D 64 with ACP's
# bound from QK-norm.
# Usage, from the repo root: COMMIT=<tree> bash scripts/gpu.sh bash scripts/gpu_issue16_s24_check2.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s24-check2}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
timeout 330 python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py -p no:cacheprovider \
    --durations=8 2>&1 | tail -n 14
timeout 100 python3 scripts/diag_acp_heads.py --shapes 4096x64 \
    --bwd-variants '{"kv": {"FUSE_DQ": "tma", "BM": 32, "BN": 64, "maxnreg": null}}' '{"kv": {"BM": 64}}' \
    --out "$OUT/$tag-acp-heads-bwd.json" 2>&1 | grep -E "^T .*bwd|bwd:" | grep -v "fwd nan" | tail -n 12
commit=(); [[ -n "${COMMIT:-}" ]] && commit=(--commit "$COMMIT")
timeout 200 python3 -m lapse.cli bench attention --seq-lens 4096 8192 16384 --tokens 32768 --heads 24 \
    --head-dim 64 --providers sdpa-default lapse lapse-acp --graph-times --acp-bound qk-norm \
    --out-dir "$OUT/$tag-attention-d64-qk-norm" "${commit[@]}" 2>&1 | grep -E "^\| (sdpa|lapse)|^## |CUDA graph" | head -n 40
