#!/usr/bin/env bash
# Issue 16, twenty-second session: the dense forward's options at T 4k on this GPU (the kernel
# alone, each variant over the table's config: tune_fox_fwd.py --variants), then lapse bench
# attention at D 64 (ACP's norm pass at its new speed).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_s22_sweep.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s22-sweep}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
cd scripts
timeout 200 python3 tune_fox_fwd.py --shapes 4096x64 --modes dense --out "$OUT/$tag-fwd-d64-4k.json" --variants \
    '{"num_stages": 4}' '{"num_stages": 2}' '{"BN": 128, "num_warps": 8}' '{"BN": 128}' '{"TMA": "host"}' \
    '{"maxnreg": 128}' '{"LOOPS": 3}' '{"LOOPS": 1}' 2>&1 | grep -v -i warn | tail -n 3
timeout 200 python3 tune_fox_fwd.py --shapes 4096x128 --modes dense --out "$OUT/$tag-fwd-d128-4k.json" --variants \
    '{"num_stages": 2}' '{"BN": 64}' '{"BN": 64, "num_stages": 4}' '{"TMA": true}' '{"LOOPS": 3}' \
    '{"BM": 64, "num_warps": 4}' 2>&1 | grep -v -i warn | tail -n 3
python3 - "$OUT" "$tag" <<'PY'
import json, sys
for d in (64, 128):
    rows = json.load(open(f"{sys.argv[1]}/{sys.argv[2]}-fwd-d{d}-4k.json"))
    rows = rows["rows"] if isinstance(rows, dict) else rows
    for r in rows:
        c = r["config"] if r["config"] == "default" else {k: v for k, v in r["config"].items()}
        print(d, r.get("ms"), r.get("x_sdpa"), r.get("nan"), r.get("error", ""), c)
PY
cd ..
timeout 200 python3 -m lapse.cli bench attention --seq-lens 4096 8192 16384 --tokens 32768 --heads 24 \
    --head-dim 64 --providers sdpa-default lapse lapse-acp ${COMMIT:+--commit $COMMIT} \
    --out-dir "$OUT/$tag-attention-d64" 2>&1 | grep -E "^\| (sdpa|lapse)|^## |GPU time" | head -n 30
