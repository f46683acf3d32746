#!/usr/bin/env bash
# Issue 16, twenty-fourth session: more programs a multiprocessor for the short programs of
# ACP's local heads (and for the dense forward at 4k). Options whose sm_90 compile (read on the
# CPU with scripts/kernel_resources.py) fits more programs a multiprocessor without spilling much:
# - D 64 ACP forward at 128 registers and 2 stages: four programs of 4 warps (the table: three,
#   at 168), 24 B of spills; with 32-key tiles, none;
# - D 128 ACP forward with 32-key tiles at 168 registers: three programs (the table: two, at 255
#   registers with 48 B of spills), no spills;
# - D 64 dense forward with 64-row tiles at 128 registers and 2 stages: four programs, no spills.
# The kernels alone on the bench's workload by head set (all, global, local:
# scripts/diag_acp_heads.py), then the dense forward's options (tune_fox_fwd.py --variants).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_s24_occupancy.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s24-occupancy}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
timeout 200 python3 scripts/diag_acp_heads.py --shapes ${SHAPES64:-4096x64 8192x64} \
    --fwd-variants '{"maxnreg": 128, "num_stages": 2}' '{"maxnreg": 128, "num_stages": 2, "BN": 32}' \
    '{"maxnreg": 128, "num_stages": 2, "FIXED_MAX": false}' \
    --out "$OUT/$tag-acp-heads-d64.json" 2>&1 | grep -v "^T " | tail -n 40
timeout 150 python3 scripts/diag_acp_heads.py --shapes ${SHAPES128:-4096x128 8192x128} \
    --fwd-variants '{"BN": 32, "maxnreg": 168}' '{"BN": 32, "maxnreg": 168, "num_stages": 2}' \
    --out "$OUT/$tag-acp-heads-d128.json" 2>&1 | grep -v "^T " | tail -n 30
timeout 150 python3 scripts/tune_fox_fwd.py --modes dense --shapes 4096x64 8192x64 \
    --variants '{"BM": 64, "maxnreg": 128, "num_stages": 2}' '{"BM": 64, "maxnreg": 128, "num_stages": 2, "BN": 32}' \
    '{"BM": 64}' '{}' --out "$OUT/$tag-fwd-dense-bm64.json" 2>&1 | tail -n 12
python3 - "$OUT" <<'PY'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/*-acp-heads-*.json")):
    for r in json.load(open(f))["rows"]:
        print(r["T"], r["D"], r["set"], r["variant"][:60], f"pruned {r['pruned']:.3f}",
              f"fwd {r['fwd_ms']:.3f}", f"bwd {r['bwd_ms']:.3f}")
for f in sorted(glob.glob(sys.argv[1] + "/*-fwd-dense-*.json")):
    for r in json.load(open(f))["rows"]:
        cfg = r["config"] if r["config"] == "default" else {k: r["config"].get(k) for k in ("BM", "BN", "num_stages", "maxnreg")}
        print(r["T"], r["D"], cfg, f"{r.get('ms', float('nan')):.3f}", r.get("error", "")[:80],
              "NaN" if r.get("nan") else "", f"{r.get('rel_diff', 0):.1e}")
PY
