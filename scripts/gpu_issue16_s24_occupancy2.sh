#!/usr/bin/env bash
# Issue 16, twenty-fourth session, second call: the options of the first (gpu_issue16_s24_occupancy.sh)
# that won at 4k and 8k, now also at 16k (tune_fox_fwd.py checks each against the default's
# output), and the backward's kernels at four programs a multiprocessor: 32-key dK/dV tiles at 128
# registers (8 B of spills on the sm_90 compile), 64 x 32 dQ tiles at 128 (60 B), each alone and
# together; 16-query dK/dV steps (no spills at 168). tune_fox_bwd.py checks the gradients.
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_s24_occupancy2.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s24-occupancy2}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
SH="${SHAPES:-4096x64 8192x64 16384x64}"
timeout 120 python3 scripts/tune_fox_fwd.py --modes acp --shapes $SH \
    --variants '{"maxnreg": 128, "num_stages": 2}' '{}' --out "$OUT/$tag-fwd-acp.json" 2>&1 | tail -n 4
timeout 120 python3 scripts/tune_fox_fwd.py --modes dense --shapes $SH \
    --variants '{"BM": 64, "maxnreg": 128, "num_stages": 2}' '{}' --out "$OUT/$tag-fwd-dense.json" 2>&1 | tail -n 4
timeout 300 python3 scripts/tune_fox_bwd.py --no-fused --shapes ${BWD_SHAPES:-4096x64 16384x64} \
    --variants '{"kv": {"BN": 32, "maxnreg": 128}}' '{"kv": {"BN": 32, "maxnreg": 128, "num_stages": 2}}' \
               '{"q": {"BN": 32, "maxnreg": 128}}' '{"kv": {"BN": 32, "maxnreg": 128}, "q": {"BN": 32, "maxnreg": 128}}' \
               '{"kv": {"BM": 16}}' '{}' \
    --out "$OUT/$tag-bwd-d64.json" 2>&1 | tail -n 4
python3 - "$OUT" <<'PY'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/*-fwd-*.json")):
    for r in json.load(open(f))["rows"]:
        cfg = r["config"] if r["config"] == "default" else {k: r["config"].get(k) for k in ("BM", "BN", "num_stages", "maxnreg")}
        print("fwd", r["T"], r["D"], "acp" if r["acp"] else "dense", cfg, f"{r.get('ms', float('nan')):.3f}",
              r.get("error", "")[:80], "NaN" if r.get("nan") else "", f"{r.get('rel_diff', 0):.1e}")
for f in sorted(glob.glob(sys.argv[1] + "/*-bwd-*.json")):
    for r in json.load(open(f))["rows"]:
        print("bwd", r["T"], r["D"], "acp" if r["acp"] else "dense", r["varied"][:80], f"{r.get('bwd_ms', float('nan')):.3f}",
              r.get("error", "")[:90], "NaN" if r.get("nan") else "", f"{r.get('rel_diff', 0):.1e}")
PY
