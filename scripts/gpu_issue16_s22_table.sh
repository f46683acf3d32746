#!/usr/bin/env bash
# Issue 16, twenty-second session: the op's GPU tests of the tables' options, then lapse bench
# attention at D 64 and D 128 (the issue's workload) on whichever GPU runs it (first: an H100,
# the GPU the issue was filed on, not measured since the fourteenth session's tables).
# Usage, from the repo root: COMMIT=<this tree> bash scripts/gpu.sh bash scripts/gpu_issue16_s22_table.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s22-table}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
commit=(); [[ -n "${COMMIT:-}" ]] && commit=(--commit "$COMMIT")
if [[ -z "${NO_TESTS:-}" ]]; then
    timeout 240 python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py -p no:cacheprovider --tb=short \
        -k "route or never_steps_down or long_acp or other_load_options or test_triton_gpu or kept_ds" 2>&1 \
        | grep -E "^(E |FAILED|ERROR)|passed|failed" | head -n 20
fi
for d in ${BENCH_DIMS:-64 128}; do
    timeout 200 python3 -m lapse.cli bench attention --seq-lens 4096 8192 16384 --tokens 32768 --heads 24 \
        --head-dim "$d" --providers sdpa-default lapse lapse-acp \
        --out-dir "$OUT/$tag-attention-d$d" "${commit[@]}" 2>&1 | grep -E "^\| (sdpa|lapse)|^## |GPU time" | head -n 30
done
