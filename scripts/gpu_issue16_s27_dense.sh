#!/usr/bin/env bash
# Issue 16, twenty-seventh session: the dense forward's tiles at D 128 on the bench's own workload
# (24 heads, B x T = 32k), T 4k and 8k, every tile option with the table's other switches kept
# (ROW_BIAS, FIXED_MAX, PAIRS); tune_fox_fwd.py checks each option's output against the table's.
# The target it serves: the dense forward at most 1.15x cuDNN, missed at D 128, 4k on an H100.
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_s27_dense.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 BENCH_WORKLOAD=1
OUT="${OUT:-runs/issue16-s27-dense}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
timeout "${SWEEP_TIMEOUT:-480}" python3 scripts/tune_fox_fwd.py --modes dense --keep-switches \
    --shapes ${SHAPES:-4096x128x24 8192x128x24} --block-m ${BM:-64 128} --block-n ${BN:-64 128} \
    --warps ${WARPS:-4 8} --stages ${STAGES:-2 3 4} --tma ${TMA:-2} \
    --out "$OUT/$tag-dense-d128.json" > "$OUT/$tag-dense-d128.log" 2>&1
tail -n 4 "$OUT/$tag-dense-d128.log"
python3 - "$OUT/$tag-dense-d128.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
for r in sorted(rows, key=lambda r: (r["T"], r.get("ms", 1e9))):
    cfg = r["config"] if r["config"] == "default" else {k: r["config"].get(k) for k in
                                                       ("BM", "BN", "num_warps", "num_stages", "TMA")}
    print(r["T"], r["D"], cfg, r.get("ms"), r.get("x_sdpa"), r.get("rel_diff"), r.get("error", "")[:80])
PY
