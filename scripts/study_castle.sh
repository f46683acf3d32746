#!/usr/bin/env bash
# The CASTLE study: CASTLE, CASTLE-SWL and the Transformer (LLaMA) at matched
# parameters, the same data, steps and recipe, two seeds each, trained concurrently on
# one GPU; then per-token loss over validation windows and one report.
#
#   The gpu-20m preset's shapes (5 x 512, the Transformer's 8 heads of 64; the castle
#   aliases keep round(4/7 * 8) = 5 heads of 64, within 4% of its parameters), byte-level
#   tokens (vocabulary 512), context SEQ = 2048 (the paper's), BATCH x SEQ tokens per
#   step, STEPS steps (lr 2e-3, 10% warm-up, cosine), the Python sources of the machine.
#
# Usage, from the repo root on one GPU (under 10 minutes):
#   bash scripts/gpu.sh bash scripts/study_castle.sh
# It leaves $OUT/study.tar.gz: the run folders without checkpoints, the evaluations and
# report.md (unpacked into docs/study/castle/). A CPU dry run of the pipeline:
#   PRESET=cpu-tiny SEQ=128 STEPS=3 BATCH=4 MICRO=4 BYTES=300000 MINUTES=1 NSEQ=2 \
#   EXTRA="--device cpu --no-compile" EVAL_EXTRA="--device cpu" OUT=/tmp/castle-study \
#   RUNS=/tmp/castle-study/runs DATA=/tmp/castle-study/data bash scripts/study_castle.sh
set -euo pipefail
export PYTHONUNBUFFERED=1
PRESET="${PRESET:-gpu-20m}"
SEQ="${SEQ:-2048}"
STEPS="${STEPS:-400}"
LR="${LR:-2e-3}"
BATCH="${BATCH:-16}"
MICRO="${MICRO:-16}"
BYTES="${BYTES:-60000000}"
MINUTES="${MINUTES:-4}"
NSEQ="${NSEQ:-32}"
SEEDS="${SEEDS:-0 1}"
ARCHS="${ARCHS:-transformer-llama castle castle-swl}"
MODEL="${MODEL:---model.vocab-size 512} --model.max-seq-len $SEQ"
EXTRA="${EXTRA:-}"
EVAL_EXTRA="${EVAL_EXTRA:-}"
OUT="${OUT:-runs/castle-study-out}"
RUNS="${RUNS:-/tmp/castle-study/runs}"
DATA="${DATA:-/tmp/castle-study/data}"
BUDGET="${BUDGET:-560}"  # seconds for the whole script: evaluations that would run past it are cut
source "$(dirname "${BASH_SOURCE[0]}")/study_lib.sh"
mkdir -p "$OUT" "$RUNS"
rm -rf "${RUNS:?}"/*
date -u +"start %FT%TZ"

echo "== data (built once, before the runs read it)"
build_data "$PRESET" "$DATA" "$BYTES"

echo "== training $(echo $ARCHS | wc -w) architectures x seeds {$SEEDS} concurrently"
common="--data-dir $DATA --seq-len $SEQ --batch-size $BATCH --micro-batch-size $MICRO --steps $STEPS
        --warmup-steps $((STEPS / 10)) --lr $LR --log-every 10 --val-every $((STEPS / 4)) --val-batches 4
        --checkpoint-every 0 --time-limit-minutes $MINUTES --tokenizer byte --corpus.max-bytes $BYTES
        --no-progress --model.no-acp $MODEL $EXTRA"
pids=()
names=()
for arch in $ARCHS; do
    for seed in $SEEDS; do
        name="$arch-s$seed"
        names+=("$name")
        $L train "$PRESET" --run-dir "$RUNS/$name" --model.arch "$arch" --seed "$seed" $common \
            > "$OUT/train-$name.log" 2>&1 &
        pids+=($!)
    done
done
for pid in "${pids[@]}"; do wait "$pid" || { echo "a training run failed"; tail -20 "$OUT"/train-*.log; exit 1; }; done
tail -n 2 "$OUT"/train-*.log
date -u +"trained %FT%TZ"
pack

M=()
for name in "${names[@]}"; do M+=("$RUNS/$name"); done
echo "== evaluations (each cut at the time left of BUDGET)"
run $L eval per-token-loss --models "${M[@]}" --names "${names[@]}" --seq-len "$SEQ" --num-sequences "$NSEQ" \
    --out-dir "$RUNS/eval-per-token" --no-progress $EVAL_EXTRA
$L report "${M[@]}" --out "$RUNS/report.md" --title "CASTLE study: matched parameters, context $SEQ, same data and steps"
date -u +"done %FT%TZ"
pack
ls -la "$OUT"
