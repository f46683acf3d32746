#!/usr/bin/env bash
# Issue 16, twenty-third session: the forward's PERSISTENT option (a few programs a
# multiprocessor, each looping over query tiles) on the GPU: its GPU tests, then the kernels
# alone against the tables in one process (tune_fox_fwd.py --variants; the table timed first
# and again last, for the call's spread).
# Measured at 7c1f193 (the option was then taken out: it lost everywhere, BENCHMARKS.md,
# "Twenty-third session"); to rerun: git checkout 7c1f193, then
# bash scripts/gpu.sh bash scripts/gpu_issue16_s23_persistent.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s23-persistent}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
if [[ -z "${NO_TESTS:-}" ]]; then
    timeout 300 python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py -k "persistent" \
        -p no:cacheprovider 2>&1 | tail -n 3
fi
timeout "${TUNE_TIMEOUT:-420}" python3 scripts/tune_fox_fwd.py --shapes ${SHAPES:-4096x64 8192x64 16384x64 4096x128 8192x128 16384x128} \
    --variants '{"PERSISTENT": 1}' '{"PERSISTENT": 2}' ${EXTRA_VARIANTS:-} '{}' \
    --out "$OUT/$tag-fwd-persistent.json" 2>&1 | tail -n 20
python3 - "$OUT/$tag-fwd-persistent.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
for r in rows:
    cfg = r["config"] if r["config"] == "default" else {k: v for k, v in r["config"].items() if k in ("PERSISTENT",)} or "default again"
    print(r["T"], r["D"], "acp" if r["acp"] else "dense", cfg, f"{r.get('ms', float('nan')):.3f}", r.get("error", ""),
          "NaN" if r.get("nan") else "", f"{r.get('rel_diff', 0):.1e}")
PY
