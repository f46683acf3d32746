#!/usr/bin/env bash
# Issue 14's speed target, the next GPU call (one call, about 6 minutes; BENCHMARKS.md,
# "Eighth session", says why each step):
#   1. the GPU tests of the paged store's helpers and DCP (move_rows changed after its last
#      GPU run);
#   2. the paged decode op with and without a per-slot bias at DCP's and 125M's shapes (is
#      the FoX bias path, which DCP's drop flags take, the paged DCP step's extra ~0.5 ms?);
#   3. DCP against the dense store where the step is bound by the device (125M, 64 x 2048,
#      a random DCP model dropping about half, passes inside the timed steps).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue14_next.sh
# (results under $OUT, else runs/issue14-next).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue14-next}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null || true
python3 -m pytest -q -m gpu tests/ops/test_paging.py tests/ops/test_dcp_paged_drop.py tests/layers/test_dcp_layer.py \
    2>&1 | tail -n 2
python3 scripts/bench_paged_decode.py --shapes 64x2048 8x2048 --heads 12 --held 0.5 --c-dtype float32 \
    --out "$OUT/paged-bias.json" 2>&1 | grep -v -i warn | tail -n 6
python3 scripts/gpu_dcp_decode_device_bound.py --preset 125m --batch 64 --prompt 2048 \
    --out "$OUT/dcp125m.json" 2>&1 | grep -v -i warn | tail -n 4
