#!/usr/bin/env bash
# Issue 16, twenty-seventh session: the flat ACP forward (flat_fwd.py, FLAT in the forward's
# config). Its GPU tests, then the forward kernels alone on the bench's workload (the table
# against FLAT variants; tune_fox_fwd.py checks each one's output against the table's), then
# the op end to end, eager and from a CUDA graph (ab_fwd_options.py). The kernel was tried and
# taken out again (BENCHMARKS.md, "Twenty-seventh session"): run this at 65026ee.
# Usage, from the repo root: git checkout 65026ee && bash scripts/gpu.sh bash scripts/gpu_issue16_s27_flat.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 BENCH_WORKLOAD=1
OUT="${OUT:-runs/issue16-s27-flat}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
if [[ -z "${NO_TESTS:-}" ]]; then
    timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/ops/test_forgetting_triton.py -k "flat_forward_gpu" 2>&1 | tail -n 6
fi
default_variants='{"FLAT":4} {"FLAT":3} {"FLAT":2} {"FLAT":4,"num_stages":3} {"FLAT":2,"TMA":"host"}'
read -r -a variants <<< "${VARIANTS:-$default_variants}"
timeout "${KERNEL_TIMEOUT:-200}" python3 scripts/tune_fox_fwd.py --modes acp \
    --shapes ${KERNEL_SHAPES:-4096x64x24 8192x64x24 16384x64x24 4096x128x24} \
    --variants "${variants[@]}" --out "$OUT/$tag-flat-kernels.json" > "$OUT/$tag-flat-kernels.log" 2>&1
tail -n 3 "$OUT/$tag-flat-kernels.log"
python3 - "$OUT/$tag-flat-kernels.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    cfg = r["config"] if r["config"] == "default" else {k: v for k, v in r["config"].items()
                                                       if k in ("FLAT", "num_stages", "TMA", "maxnreg")}
    print(r["T"], r["D"], cfg, r.get("ms"), r.get("rel_diff"), r.get("nan"), r.get("error", ""))
PY
if [[ -n "${AB_VARIANTS:-}" ]]; then
    read -r -a ab <<< "$AB_VARIANTS"
    timeout "${AB_TIMEOUT:-200}" python3 scripts/ab_fwd_options.py --shapes ${AB_SHAPES:-4096x64x24 8192x64x24} \
        --variants "${ab[@]}" --rounds 2 --out "$OUT/$tag-ab-flat.json" 2>&1 | grep -v Warning
fi
