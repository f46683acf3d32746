# What the study scripts share (sourced by scripts/study_*.sh, which set
# BUDGET, OUT, RUNS and DATA first): the time left of the budget, packing the run folders
# without checkpoints, building the byte-level data once before concurrent runs read it, and
# the DCP trainings.
L="python3 -m lapse.cli"
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) > 5 ? BUDGET - ($(date +%s) - T0) : 5 )); }
pack() { (cd "$RUNS/.." && tar --exclude='checkpoint-*' --exclude='trainer_state.pt' -czf - runs) > "$OUT/study.tar.gz"; }
run() { timeout "$(left)" "$@" || echo "cut or failed (rc=$?): $*"; }

# build_data PRESET DATA_DIR MAX_BYTES: tokenise the machine's Python sources, byte-level
build_data() {
python3 - "$1" "$2" "$3" <<'PY'
import sys
from pathlib import Path
from lapse.data import CorpusConfig
from lapse.train import prepare_data, train_preset
preset, data, max_bytes = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
cfg = train_preset(preset, tokenizer="byte", data_dir=data, corpus=CorpusConfig(max_bytes=max_bytes))
d = prepare_data(cfg, progress=False)
print(d.train, d.validation)
PY
}

# phase NAME: a heading with the seconds since the start
phase() { echo "== $1 (t = $(( $(date +%s) - T0 )) s)"; }

# dcp_trainings: what study_dcp.sh trains, from its PRESET, MODEL, SEQ, BYTES, DATA, RUNS,
# OUT, GAMMAS, PRE_* and FT_* settings: the byte-level data; a dense transformer-llama base
# ($RUNS/base: PRE_STEPS, PRE_MINUTES at most); then the base fine-tuned into DCP once per
# gamma in GAMMAS, concurrently ($RUNS/dcp-g<gamma>: the whole model, alpha a cosine 1 -> 8
# over FT_STEPS, FT_MINUTES at most). Logs: $OUT/train-*.log.
# Sets DCP_RUNS (the fine-tunes' folders, in the order of GAMMAS); exits when a training fails.
dcp_trainings() {
    phase "data (built once, before the runs read it)"
    build_data "$PRESET" "$DATA" "$BYTES"
    local data="--data-dir $DATA --tokenizer byte --corpus.max-bytes $BYTES --seq-len $SEQ --no-progress"
    phase "pretraining the dense base (transformer-llama, context $SEQ)"
    $L train "$PRESET" --run-dir "$RUNS/base" --model.arch transformer-llama --model.no-acp $MODEL \
        --model.max-seq-len "$SEQ" $data --batch-size "$PRE_BATCH" --steps "$PRE_STEPS" \
        --warmup-steps $((PRE_STEPS / 10)) --lr "$PRE_LR" --log-every 25 --val-every $((PRE_STEPS / 5)) \
        --val-batches 4 --acp-stats-every 0 --checkpoint-every 0 --time-limit-minutes "$PRE_MINUTES" \
        $PRE_EXTRA > "$OUT/train-base.log" 2>&1 || { echo "pretraining failed"; tail -n 30 "$OUT/train-base.log"; exit 1; }
    tail -n 3 "$OUT/train-base.log"
    phase "fine-tuning into DCP, gamma in {$GAMMAS}, concurrently"
    local pids=() g pid
    DCP_RUNS=()
    for g in $GAMMAS; do
        $L train "$PRESET" --run-dir "$RUNS/dcp-g$g" --init-from "$RUNS/base" --model.attention dcp --model.no-acp \
            --dcp.gamma "$g" --dcp.alpha-start 1 --dcp.alpha-end 8 --dcp.no-interaction-only $data \
            --batch-size "$FT_BATCH" --steps "$FT_STEPS" --warmup-steps $((FT_STEPS / 10)) --lr "$FT_LR" \
            --log-every 10 --val-every $((FT_STEPS / 4 > 0 ? FT_STEPS / 4 : 1)) --val-batches 4 \
            --acp-stats-every 0 --checkpoint-every 0 --time-limit-minutes "$FT_MINUTES" \
            $FT_EXTRA > "$OUT/train-dcp-g$g.log" 2>&1 &
        pids+=($!) DCP_RUNS+=("$RUNS/dcp-g$g")
    done
    for pid in "${pids[@]}"; do
        wait "$pid" || { echo "a fine-tuning run failed"; tail -n 20 "$OUT"/train-dcp-*.log; exit 1; }
    done
    tail -n 3 "$OUT"/train-dcp-*.log
}
