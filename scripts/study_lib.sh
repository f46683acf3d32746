# What the study scripts share (sourced by scripts/study_*.sh, which set BUDGET, OUT, RUNS
# and DATA first): the time left of the budget, packing the run folders without
# checkpoints, and building the byte-level data once before concurrent runs read it.
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
