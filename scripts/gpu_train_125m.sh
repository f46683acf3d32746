#!/usr/bin/env bash
# On the lent GPU (one H100/H200): the issue-3 training measurements, in one call.
#   1. a tiny run on CUDA (the trainer's GPU path: bf16 autocast, Triton kernels);
#   2. FoX (Pro) 125M at context 16384 with ACP trained for TRAIN_MINUTES on the local
#      Python sources (BPE 50,304 learned locally), so the forget gates decay as trained;
#   3. `lapse bench train` on that checkpoint: ACP on vs off, same weights and batches.
# Results go to $OUT (run folder files, bench JSON/Markdown). Usage, from the repo root:
#   bash scripts/gpu.sh bash scripts/gpu_train_125m.sh
set -uo pipefail
# shellcheck disable=SC2086  # TRAIN_EXTRA and VARIANTS are words
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/gpu}"
TRAIN_MINUTES="${TRAIN_MINUTES:-4}"
VARIANTS="${VARIANTS-dense acp dense-compile acp-compile transformer-compile}"  # of step 3; "": none
SKIP_TINY="${SKIP_TINY:-0}"  # 1: leave out step 1
TRAIN_EXTRA="${TRAIN_EXTRA:-}"  # more options of step 2's `lapse train`, e.g. --cuda-graphs
mkdir -p "$OUT"
rm -rf /tmp/tiny /tmp/r125  # runs of an earlier call on a still-warm machine (the data cache stays)
L="python3 -m lapse.cli"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

if [[ "$SKIP_TINY" != 1 ]]; then
    echo "== 1. tiny run on CUDA"
    $L train cpu-tiny --run-dir /tmp/tiny --data-dir /tmp/data --steps 20 --no-progress
    cp /tmp/tiny/report.md "$OUT/tiny-report.md"
    rm -rf /tmp/tiny
fi

echo "== 2. 125M FoX (Pro) + ACP at T=16384, $TRAIN_MINUTES minutes"
t0=$(date +%s)
$L train 125m-16k --run-dir /tmp/r125 --data-dir /tmp/data --batch-size 8 --micro-batch-size 1 \
    --steps 400 --warmup-steps 40 --lr 2e-3 --time-limit-minutes "$TRAIN_MINUTES" --log-every 10 \
    --val-every 0 --acp-stats-every 25 --checkpoint-every 0 --corpus.max-bytes 200000000 --no-progress $TRAIN_EXTRA
echo "train wall: $(( $(date +%s) - t0 )) s"
mkdir -p "$OUT/r125"
cp /tmp/r125/{metrics.jsonl,report.md,summary.json,loss.png,config.json} "$OUT/r125/"
cat /tmp/r125/report.md

[[ -z "$VARIANTS" ]] && exit 0
echo "== 3. bench train: ACP on vs off on the trained weights"
$L bench train --run /tmp/r125 --variants $VARIANTS \
    --steps 4 --warmup 2 --out-dir "$OUT/bench"
