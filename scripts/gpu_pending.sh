#!/usr/bin/env bash
# What was built in a session without a GPU and awaits its first GPU run, in three calls of
# the device tool (each under its 10-minute limit; PART 1, 2, 3), from the repo root:
#   bash scripts/gpu.sh bash scripts/gpu_pending.sh "$(cat .commit)" 1   # tests, CASTLE fold, DCP pass
#   bash scripts/gpu.sh bash scripts/gpu_pending.sh "$(cat .commit)" 2   # decode steps, DCP fine-tune step
#   bash scripts/gpu.sh bash scripts/gpu_pending.sh "$(cat .commit)" 3   # 760M at 16k, DCP pass eager
# with .whl/ and .commit carried (scripts/fetch_wheels.sh; .commit holds
# `git rev-parse --short HEAD`, which the device's copy of the tree does not know).
#   1. the GPU tests of the paths changed since they last ran on a GPU: the decode step
#      (fused projections that follow the weights, the scoped recompile limit), CASTLE's
#      deferred lookahead decode, DCP compiled with alpha as a tensor, the paged decode op,
#      CASTLE's paged decode kernel (against the torch path, and under reduce-overhead);
#   2. CASTLE's immediate against deferred decode step per layer (scripts/bench_castle_fold.py);
#   3. decode steps at 125M, 8 x 4k: fox-pro, transformer-llama, castle (immediate and
#      castle_fold_every=8) beside HF's compiled Llama, to compare with BENCHMARKS.md, and
#      a kernel profile of the fox-pro and transformer-llama steps;
#   4. DCP's fine-tuning step at context 1024 against the dense step, eager and compiled;
#   5. 760M at 16k, ACP against the Transformer, with activation checkpointing;
#   6. DCP's eviction pass at 64 x 1920, compiled (part 1) and eager with a profile (part 3).
# Results go to $OUT (the device tool's folder) or ./gpu-pending.
set -uo pipefail
COMMIT="${1:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
PART="${2:-1}"
OUT="${OUT:-gpu-pending}"
mkdir -p "$OUT"
L="python3 -m lapse.cli"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"

if [[ "$PART" == 1 ]]; then
echo "== 1. GPU tests"
timeout 240 python3 -m pytest -m gpu -q -s -p no:cacheprovider \
    tests/generation tests/ops/test_forgetting_paged.py tests/ops/test_castle_decode_fold_gpu.py \
    tests/ops/test_castle_paged_gpu.py \
    tests/layers/test_dcp_layer.py 2>&1 | tail -n 40 | tee "$OUT/tests.txt"

echo "== 2. CASTLE deferred decode, per layer"
timeout 150 python3 scripts/bench_castle_fold.py --out "$OUT/castle_fold.json" 2>&1 | tail -n 30

echo "== 6a. DCP's eviction pass at 64 x 1920, compiled"
timeout 100 python3 scripts/profile_evict.py --preset gpu-20m --arch transformer-llama --attention dcp \
    --policy dcp --batch 64 --prompt 1920 --passes 6 --compile 2>&1 | tail -n 8 | tee "$OUT/evict-dcp-compiled.txt"
fi

if [[ "$PART" == 2 ]]; then
echo "== 3. decode steps, 8 x 4k"
timeout 170 $L bench decode --archs fox-pro transformer-llama castle --workloads 8x4096 \
    --providers lapse-compile hf-llama-compile --steps 32 --commit "$COMMIT" \
    --out-dir "$OUT/decode" 2>&1 | tail -n 12
timeout 100 $L bench decode --archs castle --castle-fold-every 8 --workloads 8x4096 \
    --providers lapse-compile --steps 32 --commit "$COMMIT" --out-dir "$OUT/decode-fold8" 2>&1 | tail -n 6

echo "== 3b. where the 8 x 4k decode step's GPU time goes (the FoX (Pro) step misses 2x the limit there)"
timeout 90 python3 scripts/profile_decode.py --arch fox-pro transformer-llama --rows 40 2>&1 \
    | grep -v -i warn | cut -c1-170 | tee "$OUT/profile_decode.txt" | tail -n 100

echo "== 4. DCP fine-tuning step, context 1024"
timeout 150 $L bench train --preset 125m --arch transformer-llama --seq-len 1024 --batch-size 8 \
    --micro-batch-size 8 --steps 6 --warmup 2 --variants transformer transformer-compile dcp dcp-compile \
    --commit "$COMMIT" --out-dir "$OUT/train-dcp" 2>&1 | tail -n 12

fi

if [[ "$PART" == 3 ]]; then
echo "== 5. 760M at 16k with activation checkpointing (OOM without it, issue 16)"
timeout 180 $L bench train --preset 760m --seq-len 16384 --batch-size 2 --micro-batch-size 1 --steps 3 \
    --warmup 1 --variants acp transformer --activation-checkpointing --commit "$COMMIT" \
    --out-dir "$OUT/train-760m-16k" 2>&1 | tail -n 8

echo "== 6b. DCP's eviction pass at 64 x 1920, eager, with a profile (25 ms per pass in the last GPU bench)"
timeout 120 python3 scripts/profile_evict.py --preset gpu-20m --arch transformer-llama --attention dcp \
    --policy dcp --batch 64 --prompt 1920 --passes 4 2>&1 | tail -n 40 | tee "$OUT/evict-dcp-eager.txt"
fi
