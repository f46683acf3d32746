#!/usr/bin/env bash
# Issue 16, twenty-fourth session: the D 64 tables at four programs a multiprocessor, checked and
# timed on the GPU. The forward's GPU tests (the float64 oracle at the tables' shapes, the 128-row
# dense tiles forced, the routed launches, the flipped options), then the kernels alone against the
# previous tables' options in one process (tune_fox_fwd.py --variants: the ACP forward at 168
# registers and 3 stages, the dense forward's 128-row tiles), then the bench at D 64 with
# --graph-times (ACP's bound "auto"; with QK_NORM=1 also the bound from QK-norm).
# Usage, from the repo root: COMMIT=<tree> bash scripts/gpu.sh bash scripts/gpu_issue16_s24_check.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s24-check}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
if [[ -z "${NO_TESTS:-}" ]]; then
    timeout 240 python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py -p no:cacheprovider 2>&1 | tail -n 3
fi
if [[ -z "${NO_AB:-}" ]]; then
    timeout 100 python3 scripts/tune_fox_fwd.py --modes acp --shapes 4096x64 8192x64 16384x64 \
        --variants '{"maxnreg": 168, "num_stages": 3}' '{}' --out "$OUT/$tag-fwd-acp.json" 2>&1 | tail -n 4
    timeout 100 python3 scripts/tune_fox_fwd.py --modes dense --shapes 4096x64 8192x64 \
        --variants '{"BM": 128, "maxnreg": null, "num_stages": 3}' '{}' --out "$OUT/$tag-fwd-dense.json" 2>&1 | tail -n 4
    python3 - "$OUT" <<'PY'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/*-fwd-*.json")):
    for r in json.load(open(f))["rows"]:
        cfg = r["config"] if r["config"] == "default" else {k: r["config"].get(k) for k in ("BM", "num_stages", "maxnreg")}
        print("fwd", r["T"], r["D"], "acp" if r["acp"] else "dense", cfg, f"{r.get('ms', float('nan')):.3f}",
              r.get("error", "")[:80], "NaN" if r.get("nan") else "", f"{r.get('rel_diff', 0):.1e}")
PY
fi
commit=(); [[ -n "${COMMIT:-}" ]] && commit=(--commit "$COMMIT")
bounds=(auto); [[ -n "${QK_NORM:-}" ]] && bounds+=(qk-norm)
for bound in "${bounds[@]}"; do
    timeout 280 python3 -m lapse.cli bench attention --seq-lens 4096 8192 16384 --tokens 32768 --heads 24 \
        --head-dim 64 --providers sdpa-default lapse lapse-acp --graph-times --acp-bound "$bound" \
        --out-dir "$OUT/$tag-attention-d64-$bound" "${commit[@]}" 2>&1 | grep -E "^\| (sdpa|lapse)|^## |CUDA graph" | head -n 40
done
