#!/usr/bin/env bash
# Issue 16, twentieth session: the backward with dS kept (FUSE_DQ="ds": the dK/dV kernel stores
# dS and its key tiles' row sums, one product a tile makes dQ) against the two-kernel default.
# Its GPU tests (and the op's), then tune_fox_bwd.py's variants, dense and ACP, a summary of
# the times, and each kernel's time (diag_bwd_ds.py).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_ds.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-ds}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
timeout 240 python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py -p no:cacheprovider --tb=short \
    -k "kept_ds_gpu or test_triton_gpu or backward_through" 2>&1 | grep -E "^(E |FAILED|ERROR)|passed|failed" | head -n 20
timeout 300 python3 scripts/tune_fox_bwd.py --shapes ${SHAPES:-4096x64 16384x64 4096x128 16384x128} --no-fused \
    --variants '{"kv": {"FUSE_DQ": "ds"}}' '{"kv": {"FUSE_DQ": "ds", "DS_TMA": false}}' \
    --out "$OUT/$tag-bwd-ds.json" 2>&1 | grep -E "^T " | head -n 20
python3 - "$OUT/$tag-bwd-ds.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["T"], r["D"], "acp" if r["acp"] else "dense", r["varied"][:50], r.get("bwd_ms"), r.get("rel_diff"),
          r.get("nan"), r.get("error", ""), "sdpa fwd+bwd", round(r["sdpa_default_fwdbwd_ms"], 3))
PY
timeout 120 python3 scripts/diag_bwd_ds.py --out "$OUT/$tag-bwd-ds-profile.json" 2>&1 | grep "^T "
