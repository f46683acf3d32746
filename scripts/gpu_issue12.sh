#!/usr/bin/env bash
# Issue 12 measurements in one GPU call (under 10 minutes):
#   1. where an eviction pass spends its time (125M shapes, random init, 4 x 32k);
#   2. a small FoX (Pro) with ACP trained for ~2 minutes (the study's gpu-20m preset,
#      byte-level Python sources), so that ACPBoundary evicts what trained gates forget;
#   3. lapse bench decode on that run at 4 x 32k: dense store against the policies.
# Usage: bash scripts/gpu.sh bash scripts/gpu_issue12.sh COMMIT   (results under $OUT)
set -uo pipefail
export PYTHONUNBUFFERED=1
COMMIT="${1:-unknown}"
OUT="${OUT:-runs/issue12}"
mkdir -p "$OUT"
L="python3 -m lapse.cli"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== 1. eviction pass profile"
for pol in acp window; do
    timeout 120 python3 scripts/profile_evict.py --preset 125m --batch 4 --prompt 32768 --policy $pol \
        > "$OUT/profile-evict-$pol.txt" 2>&1 || echo "profile $pol failed or cut: $?"
    head -8 "$OUT/profile-evict-$pol.txt"
done
echo "== 2. training a gpu-20m FoX (Pro) + ACP"
DATA=/tmp/i12/data
timeout 250 $L train gpu-20m --run-dir /tmp/i12/fox-pro-acp --model.arch fox-pro --model.acp \
    --data-dir $DATA --tokenizer byte --corpus.max-bytes 40000000 --model.vocab-size 512 \
    --seq-len 4096 --model.max-seq-len 4096 --batch-size 16 --micro-batch-size 8 --steps 400 --warmup-steps 40 \
    --lr 2e-3 --log-every 50 --val-every 200 --val-batches 2 --checkpoint-every 200 \
    --time-limit-minutes 3 --no-progress > "$OUT/train.log" 2>&1 || echo "training rc=$?"
tail -5 "$OUT/train.log"
ls /tmp/i12/fox-pro-acp
echo "== 3. bench decode on the trained run"
timeout 280 $L bench decode --run /tmp/i12/fox-pro-acp --workloads 4x32768 --providers lapse-compile \
    --policies dense acp window h2o --every 64 --steps 128 --warmup 4 --commit "$COMMIT" \
    --out-dir "$OUT/bench-run" 2>&1 | grep -v Warning | tail -12
(cd /tmp/i12 && tar --exclude='checkpoint-*' --exclude='trainer_state.pt' -czf "$OLDPWD/$OUT/run.tar.gz" fox-pro-acp) || true
