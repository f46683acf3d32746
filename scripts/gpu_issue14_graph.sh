#!/usr/bin/env bash
# Issue 14's speed target after the passes became one CUDA graph (PagedStore.apply_policy_all)
# and the host's free lists numpy stacks: the GPU tests of compiled eviction (every policy,
# graphed passes against per-layer ones), then DCP against the dense store at 125M,
# 64 x 2048, device-bound, a pass every 64 and every 128 steps, with each pass's host time
# graphed and not (scripts/gpu_dcp_decode_device_bound.py).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue14_graph.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue14-graph}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null || true
python3 -m pytest -q -m gpu tests/generation/test_policies.py -k "compiled_generation" 2>&1 | tail -n 3
for every in 64 128; do
    PYTHONPATH="scripts:${PYTHONPATH:-}" python3 scripts/gpu_dcp_decode_device_bound.py --preset 125m --batch 64 \
        --prompt 2048 --every "$every" --steps $((2 * every + 32)) --betas 2.0 2.25 2.5 \
        --out "$OUT/dcp125m-every$every.json" 2>&1 | grep -v -i warn | tail -n 6
done
