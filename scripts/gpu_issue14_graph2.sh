#!/usr/bin/env bash
# The graphed passes' GPU test with the same tokens in both stores (the first run fed each
# store its own random tokens), the diagnosis of any failure, and DCP at 125M, 64 x 2048,
# device-bound, at beta 2.0 (38% held after the prefill on an H100: over half dropped), a
# pass every 128 (the default) and every 64 steps.
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue14_graph2.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue14-graph2}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null || true
python3 -m pytest -q -m gpu tests/generation/test_policies.py -k "compiled_generation" --tb=short 2>&1 \
    | grep -E "^(E |FAILED|[0-9]+ (passed|failed))|Error" | head -n 30
if [[ -f scripts/diag_graphed_passes.py ]]; then
    python3 scripts/diag_graphed_passes.py 2>&1 | grep -v -i warn | tail -n 40
fi
for every in 128 64; do
    python3 scripts/gpu_dcp_decode_device_bound.py --preset 125m --batch 64 --prompt 2048 --every "$every" \
        --steps $((2 * every + 32)) --betas 2.0 --graph 1 --out "$OUT/dcp125m-every$every.json" 2>&1 \
        | grep -v -i warn | grep -v '"top"' | tail -n 4
done
