#!/usr/bin/env bash
# Issue 16, prepared in the seventeenth session and not yet run: the backward's loop tiles
# through tensor descriptors made on the host (TMA="host": the dK/dV kernel's queries and
# output gradients, the dQ kernel's keys and values). Compiled for sm_90 on the CPU the dQ
# kernel at D 64 needs 176 registers with them against 234 (with a cap of 168, three programs
# a multiprocessor), and at D 128 both kernels lose their spills and 7-13% of their loop
# instructions. Its GPU tests first, then the variants twice (noise).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_bwd_tma.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-bwd-tma}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null || true
timeout 200 python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py -k "backward_through_tensor" \
    -p no:cacheprovider --tb=short 2>&1 | grep -E "^(E |FAILED|ERROR)|passed|failed" | head -n 20
for rep in 1 2; do
    timeout 150 python3 scripts/tune_fox_bwd.py --no-fused --out "$OUT/bwd-tma-$rep.json" --variants \
        '{"kv": {"TMA": "host"}}' '{"q": {"TMA": "host"}}' '{"kv": {"TMA": "host"}, "q": {"TMA": "host"}}' \
        '{"kv": {"TMA": "host"}, "q": {"TMA": "host", "maxnreg": 168}}' 2>&1 | grep -v Warning | tail -n 2
done
