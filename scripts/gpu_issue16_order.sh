#!/usr/bin/env bash
# Issue 16, eighteenth session: the order of the programs (HEADS_FIRST: every head's first
# tile before any head's second, so the longest causal tiles of all heads run first) in the
# forward and both backward kernels, and a few launch options around the new backward
# defaults (descriptors): the dQ kernel's PAIRS and stages at D 128, the forward's
# host-made descriptors at D 64 dense. The flipped-options GPU tests first (HEADS_FIRST
# included), then forward variants, then backward variants twice (noise).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_order.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-order}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null || true
timeout 200 python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py -k "other_load_options_gpu" \
    -p no:cacheprovider --tb=short 2>&1 | grep -E "^(E |FAILED|ERROR)|passed|failed" | head -n 20
timeout 150 python3 scripts/tune_fox_fwd.py --out "$OUT/fwd-order.json" --variants \
    '{"HEADS_FIRST": true}' '{"TMA": "host"}' '{"TMA": "host", "HEADS_FIRST": true}' 2>&1 | grep -v Warning | tail -n 9
for rep in 1 2; do
    timeout 120 python3 scripts/tune_fox_bwd.py --no-fused --out "$OUT/bwd-order-$rep.json" --variants \
        '{"kv": {"HEADS_FIRST": true}, "q": {"HEADS_FIRST": true}}' '{"q": {"HEADS_FIRST": true}}' \
        '{"q": {"PAIRS": true}}' '{"q": {"num_stages": 3}}' 2>&1 | grep -v Warning | tail -n 1
done
