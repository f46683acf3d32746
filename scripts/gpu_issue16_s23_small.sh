#!/usr/bin/env bash
# Issue 16, twenty-third session: the ACP forward's launch (at D 128 the routed launch of the local
# heads) with smaller programs, whose fixed start and end may cost less: 32-row tiles (Triton then
# multiplies with mma.sync, not the warpgroup products), with 4 or 2 warps, or capped at 168
# registers (at D 128: three programs a multiprocessor); 2 stages. (64-row tiles with 2 warps
# spill 1.5-3 KB a thread on the sm_90 compile: left out.) The kernels alone against
# the table in one process (tune_fox_fwd.py --variants; the table timed first and again last).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_s23_small.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s23-small}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
timeout "${TUNE_TIMEOUT:-500}" python3 scripts/tune_fox_fwd.py --modes acp --shapes ${SHAPES:-4096x64 8192x64 4096x128 8192x128} \
    --variants '{"BM": 32}' '{"BM": 32, "num_warps": 2}' '{"BM": 32, "maxnreg": 168}' '{"num_stages": 2}' '{}' \
    --out "$OUT/$tag-fwd-acp-small.json" 2>&1 | tail -n 6
python3 - "$OUT/$tag-fwd-acp-small.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
keys = ("BM", "num_warps", "num_stages", "maxnreg")
for r in rows:
    cfg = r["config"] if r["config"] == "default" else {k: r["config"].get(k) for k in keys}
    print(r["T"], r["D"], cfg, f"{r.get('ms', float('nan')):.3f}", r.get("error", "")[:80],
          "NaN" if r.get("nan") else "", f"{r.get('rel_diff', 0):.1e}")
PY
