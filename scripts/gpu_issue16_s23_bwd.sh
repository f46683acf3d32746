#!/usr/bin/env bash
# Issue 16, twenty-third session: the D 64 backward's options on the GPU at hand (the tables were
# last swept on an H200; the issue's targets are on an H100), dense and ACP, against the table in
# one process (tune_fox_bwd.py --variants; the table timed first and again last).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_s23_bwd.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s23-bwd}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
timeout "${TUNE_TIMEOUT:-540}" python3 scripts/tune_fox_bwd.py --no-fused --shapes ${SHAPES:-4096x64 16384x64} \
    --variants '{"kv": {"maxnreg": null}}' '{"kv": {"num_stages": 2}}' '{"kv": {"BN": 128, "maxnreg": null}}' \
               '{"q": {"maxnreg": null}}' '{"q": {"num_stages": 2}}' '{"q": {"BM": 128, "num_warps": 8, "maxnreg": null}}' \
               '{"kv": {"FUSE_DQ": "ds"}}' '{}' \
    --out "$OUT/$tag-bwd-d64.json" 2>&1 | tail -n 4
python3 - "$OUT/$tag-bwd-d64.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
for r in rows:
    print(r["T"], r["D"], "acp" if r["acp"] else "dense", r["varied"][:70], f"{r.get('bwd_ms', float('nan')):.3f}",
          r.get("error", "")[:90], "NaN" if r.get("nan") else "", f"{r.get('rel_diff', 0):.1e}")
PY
