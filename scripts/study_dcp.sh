#!/usr/bin/env bash
# The DCP study: one dense Transformer (LLaMA) pretrained, then fine-tuned
# into Dynamic Context Pruning four times, concurrently on one GPU, one per sparsity weight
# gamma, the same steps, data and seed; then `lapse eval dcp`: perplexity against the share of
# context dropped (step mask), per layer, and which tokens get dropped in validation snippets.
#
#   base:      the gpu-20m preset's shapes (5 x 512, 8 heads of 64) as transformer-llama,
#              byte-level tokens (vocabulary 512), context SEQ = 1024, PRE_STEPS steps of
#              PRE_BATCH x SEQ tokens (lr 2e-3, 10% warm-up, cosine), PRE_MINUTES at most,
#              on the Python sources of the machine's installation.
#   fine-tune: --init-from the base, --model.attention dcp, the whole model trained (the
#              paper's setting), alpha a cosine 1 -> 8 over FT_STEPS steps of FT_BATCH x SEQ,
#              lr FT_LR, gamma in GAMMAS, FT_MINUTES at most each (the four share the GPU).
#
# Usage, from the repo root on one GPU (about 7-7.5 minutes: data ~30 s, base
# <= 2.5 min of training + ~20 s start, fine-tunes <= 3 min + ~25 s start, report ~30 s):
#   bash scripts/gpu.sh bash scripts/study_dcp.sh
# It leaves in $OUT: study.tar.gz (the run folders without checkpoints and the report),
# the report itself (summary.md, results.json, ppl_vs_dropped.png, dropped_per_layer.png,
# drops_<run>.png, drops.html) and the logs. Every knob below is an environment variable.
# A CPU dry run of the whole pipeline in under a minute (2 cores):
#   PRESET=cpu-tiny SEQ=128 PRE_STEPS=30 PRE_BATCH=8 FT_STEPS=6 FT_BATCH=4 BYTES=400000 \
#   PRE_MINUTES=1 FT_MINUTES=1 NSEQ=4 SNIPPET=200 PRE_EXTRA="--device cpu --no-compile" \
#   FT_EXTRA="--device cpu --no-compile --model.dcp-r 16 --model.dcp-beta-init 0.02" EVAL_EXTRA="--device cpu" \
#   OUT=/tmp/dcp-study-out bash scripts/study_dcp.sh
set -euo pipefail
export PYTHONUNBUFFERED=1
PRESET="${PRESET:-gpu-20m}"
SEQ="${SEQ:-1024}"
BYTES="${BYTES:-100000000}"
PRE_STEPS="${PRE_STEPS:-2500}"
PRE_BATCH="${PRE_BATCH:-32}"
PRE_LR="${PRE_LR:-2e-3}"
PRE_MINUTES="${PRE_MINUTES:-2.5}"
PRE_EXTRA="${PRE_EXTRA:-}"
GAMMAS="${GAMMAS:-0 0.01 0.1 1}"
FT_STEPS="${FT_STEPS:-250}"
FT_BATCH="${FT_BATCH:-8}"
FT_LR="${FT_LR:-5e-4}"
FT_MINUTES="${FT_MINUTES:-3}"
FT_EXTRA="${FT_EXTRA:---no-compile}"  # the DCP mask runs eager anyway; compiling the rest costs more than it saves here
NSEQ="${NSEQ:-16}"
SNIPPET="${SNIPPET:-480}"
EVAL_EXTRA="${EVAL_EXTRA:-}"
MODEL="${MODEL:---model.vocab-size 512}"
OUT="${OUT:-runs/dcp-study-out}"
RUNS="${RUNS:-/tmp/dcp-study/runs}"
DATA="${DATA:-/tmp/dcp-study/data}"
BUDGET="${BUDGET:-530}"  # seconds for the whole script: the report is cut at what is left of it
source "$(dirname "${BASH_SOURCE[0]}")/study_lib.sh"
COMMIT="${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
mkdir -p "$OUT" "$RUNS"
rm -rf "${RUNS:?}"/*
date -u +"start %FT%TZ, commit $COMMIT"

dcp_trainings
pack  # the training logs come back even if the report is cut

phase "report: lapse eval dcp"
cmd="PRESET=$PRESET SEQ=$SEQ BYTES=$BYTES PRE_STEPS=$PRE_STEPS PRE_BATCH=$PRE_BATCH PRE_LR=$PRE_LR"
cmd+=" PRE_MINUTES=$PRE_MINUTES GAMMAS='$GAMMAS' FT_STEPS=$FT_STEPS FT_BATCH=$FT_BATCH FT_LR=$FT_LR"
cmd+=" FT_MINUTES=$FT_MINUTES NSEQ=$NSEQ bash scripts/study_dcp.sh"
run $L eval dcp "${DCP_RUNS[@]}" --base "$RUNS/base" --out-dir "$RUNS/report" --num-sequences "$NSEQ" \
    --snippets 3 --snippet-tokens "$SNIPPET" --commit "$COMMIT" --command "$cmd" \
    --title "DCP study: gamma sweep of fine-tunes of a Transformer (LLaMA), context $SEQ" $EVAL_EXTRA
[[ -d "$RUNS/report" ]] && cp -r "$RUNS/report/." "$OUT/"
phase "done"
date -u +"done %FT%TZ"
pack
ls -la "$OUT"
