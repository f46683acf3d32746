#!/usr/bin/env bash
# The FoX / ACP study: four small models trained on the same data and token
# budget, concurrently on one GPU, then every evaluation and one report.
#
#   FoX (Pro), FoX (Pro) + ACP, Transformer (Pro), Transformer (LLaMA): the gpu-20m preset
#   (5 x 512, 8 heads of 64: 16.7M parameters without the embedding for the Pro models at
#   this vocabulary, 17.3M for the LLaMA one), byte-level
#   tokens (vocabulary 512), context SEQ = 4096, BATCH x SEQ tokens per step, STEPS steps
#   (lr 2e-3, 10% warm-up, cosine), the Python sources of the machine's installation.
#
# Usage, from the repo root on one GPU (under 10 minutes):
#   bash scripts/gpu.sh bash scripts/study_fox.sh
# It leaves $OUT/study.tar.gz: the run folders without checkpoints, their evaluations and
# report.md (unpacked into docs/study/). Every knob below is an environment variable; a
# CPU dry run of the whole pipeline (about 4 minutes on 2 cores):
#   PRESET=cpu-tiny SEQ=256 STEPS=4 BATCH=4 MICRO=4 BYTES=300000 MINUTES=1 NSEQ=2 \
#   MODEL="--model.vocab-size 320" EXTRA="--device cpu --no-compile" OUT=/tmp/study bash scripts/study_fox.sh
set -euo pipefail
export PYTHONUNBUFFERED=1
PRESET="${PRESET:-gpu-20m}"
SEQ="${SEQ:-4096}"
STEPS="${STEPS:-600}"
BATCH="${BATCH:-16}"
MICRO="${MICRO:-8}"
BYTES="${BYTES:-100000000}"
MINUTES="${MINUTES:-3.5}"
NSEQ="${NSEQ:-32}"
MODEL="${MODEL:---model.vocab-size 512} --model.max-seq-len $SEQ"
EXTRA="${EXTRA:-}"
OUT="${OUT:-runs/study-out}"
RUNS="${RUNS:-/tmp/study/runs}"
DATA="${DATA:-/tmp/study/data}"
BUDGET="${BUDGET:-560}"  # seconds for the whole script: evaluations that would run past it are cut
source "$(dirname "${BASH_SOURCE[0]}")/study_lib.sh"
mkdir -p "$OUT" "$RUNS"
rm -rf "${RUNS:?}"/*
date -u +"start %FT%TZ"

echo "== data (built once, before the four runs read it)"
build_data "$PRESET" "$DATA" "$BYTES"

echo "== training the four models concurrently"
common="--data-dir $DATA --seq-len $SEQ --batch-size $BATCH --micro-batch-size $MICRO --steps $STEPS
        --warmup-steps $((STEPS / 10)) --lr 2e-3 --log-every 10 --val-every $((STEPS / 4)) --val-batches 4
        --acp-stats-every $((STEPS / 8 > 0 ? STEPS / 8 : 1)) --checkpoint-every 0 --time-limit-minutes $MINUTES
        --tokenizer byte --corpus.max-bytes $BYTES --no-progress $MODEL $EXTRA"
pids=()
for spec in fox-pro:fox-pro:--model.no-acp fox-pro-acp:fox-pro:--model.acp \
            transformer-pro:transformer-pro:--model.no-acp transformer-llama:transformer-llama:--model.no-acp; do
    IFS=: read -r name arch acp <<< "$spec"
    $L train "$PRESET" --run-dir "$RUNS/$name" --model.arch "$arch" "$acp" $common > "$OUT/train-$name.log" 2>&1 &
    pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || { echo "a training run failed"; tail -20 "$OUT"/train-*.log; exit 1; }; done
tail -n 3 "$OUT"/train-*.log
date -u +"trained %FT%TZ"
pack  # the training logs come back even if an evaluation is cut

M=("$RUNS/fox-pro" "$RUNS/fox-pro-acp" "$RUNS/transformer-pro" "$RUNS/transformer-llama")
names=(fox-pro fox-pro-acp transformer-pro transformer-llama)
echo "== evaluations (each cut at the time left of BUDGET)"
run $L eval per-token-loss --models "${M[@]}" --names "${names[@]}" --seq-len "$SEQ" --num-sequences "$NSEQ" \
    --no-progress
run $L eval ppl --models "${M[@]}" --names "${names[@]}" --num-sequences $((NSEQ / 2 > 0 ? NSEQ / 2 : 1)) \
    --context-lengths $((SEQ / 4)) $((SEQ / 2)) "$SEQ" $((SEQ * 2)) $((SEQ * 4)) --no-progress
for t in $((SEQ / 2)) "$SEQ" $((SEQ * 4)); do
    run $L eval acp --model "$RUNS/fox-pro-acp" --seq-len "$t" --num-sequences 4 \
        --out-dir "$RUNS/fox-pro-acp/eval/acp-T$t" --no-progress
done
if python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "== training throughput, ACP on vs off, on the trained FoX (Pro) + ACP weights"
    run $L bench train --run "$RUNS/fox-pro-acp" --seq-len "$SEQ" --batch-size "$BATCH" --micro-batch-size "$MICRO" \
        --variants dense-compile acp-compile --steps 6 --warmup 2 --out-dir "$RUNS/fox-pro-acp/eval/bench-train"
fi
run $L eval niah --models "${M[@]}" --context-lengths $((SEQ / 2)) "$SEQ" $((SEQ * 2)) --trials 2 --no-progress \
    --depths 0 0.25 0.5 0.75 1
$L report "${M[@]}" --out "$RUNS/report.md" --title "FoX / ACP study: four models, context $SEQ, same data and steps"
date -u +"done %FT%TZ"
pack
ls -la "$OUT"
