#!/usr/bin/env bash
# Issue 16, twenty-first session, the final call: the op's GPU tests (ROUTE included), the op's
# forward against 76f0182's in alternating processes (diag_op_host.py; carry ab_old with
# ab_old/src76 = git archive 76f0182 src), then lapse bench attention at D 64 and D 128.
# Usage, from the repo root: COMMIT=<this tree> bash scripts/gpu.sh bash scripts/gpu_issue16_s21_final.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s21-final}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
commit=(); [[ -n "${COMMIT:-}" ]] && commit=(--commit "$COMMIT")
timeout 240 python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py -p no:cacheprovider --tb=short \
    -k "route or never_steps_down or long_acp or other_load_options or test_triton_gpu or kept_ds" 2>&1 \
    | grep -E "^(E |FAILED|ERROR)|passed|failed" | head -n 20
for i in 1 2; do
    PYTHONPATH="$PWD/ab_old/src76" timeout 60 python3 scripts/diag_op_host.py --shapes 4096x128 16384x128 16384x64 \
        --label old-76f0182 --out "$OUT/$tag-op-host-old-$i.json" 2>&1 | grep -v Warn
    timeout 60 python3 scripts/diag_op_host.py --shapes 4096x128 16384x128 16384x64 --label new \
        --out "$OUT/$tag-op-host-new-$i.json" 2>&1 | grep -v Warn
done
for d in ${BENCH_DIMS:-64 128}; do
    timeout 120 python3 -m lapse.cli bench attention --seq-lens 4096 8192 16384 --tokens 32768 --heads 24 \
        --head-dim "$d" --providers sdpa-default lapse lapse-acp \
        --out-dir "$OUT/$tag-attention-d$d" "${commit[@]}" 2>&1 | grep -E "^\| (sdpa|lapse)|^## " | head -n 20
done
