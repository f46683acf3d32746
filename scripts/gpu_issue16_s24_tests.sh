#!/usr/bin/env bash
# Issue 16, twenty-fourth session: the D 64 dK/dV kernel's 64-query steps where the table now
# takes them but were not timed (grouped-query heads with ACP: --group 4, against 32-query steps),
# and at D 128 (tried: its table keeps 32), each option's gradients checked against the table's;
# then the FoX op's GPU tests at these tables.
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_s24_tests.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s24-tests}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
show() {
    python3 - "$1" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["T"], r["D"], r["group"], "acp" if r["acp"] else "dense", r["varied"][:70], f"{r.get('bwd_ms', float('nan')):.3f}",
          r.get("error", "")[:90], "NaN" if r.get("nan") else "", f"{r.get('rel_diff', 0):.1e}")
PY
}
if [[ -z "${NO_TUNE:-}" ]]; then
    timeout 100 python3 scripts/tune_fox_bwd.py --no-fused --group 4 --shapes 4096x64 16384x64 \
        --variants '{"kv": {"BM": 32}}' '{}' --out "$OUT/$tag-bwd-gqa-d64.json" > /dev/null 2>&1
    show "$OUT/$tag-bwd-gqa-d64.json"
    timeout 100 python3 scripts/tune_fox_bwd.py --no-fused --shapes 4096x128 16384x128 \
        --variants '{"kv": {"BM": 64}}' '{}' --out "$OUT/$tag-bwd-d128-bm64.json" > /dev/null 2>&1
    show "$OUT/$tag-bwd-d128-bm64.json"
fi
timeout "${TEST_TIMEOUT:-400}" python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py -p no:cacheprovider \
    --durations=6 2>&1 | tail -n 12
