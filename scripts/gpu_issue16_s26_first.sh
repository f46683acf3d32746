#!/usr/bin/env bash
# Issue 16, twenty-sixth session, first call: the Gluon ACP forward's GPU tests (their assertion
# that Gluon served the forward had not run on a GPU), then lapse bench attention at D 64 and D 128
# with --graph-times at the current tables (D 128's routed launch on Gluon; the twenty-fifth
# session did not rerun the full table at it).
# Usage, from the repo root: COMMIT=<this tree> bash scripts/gpu.sh bash scripts/gpu_issue16_s26_first.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s26-first}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
if [[ -z "${NO_TESTS:-}" ]]; then
    timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/ops/test_forgetting_triton.py -k "gluon" 2>&1 | tail -n 4
fi
commit=(); [[ -n "${COMMIT:-}" ]] && commit=(--commit "$COMMIT")
for d in ${DIMS:-64 128}; do
    timeout 250 python3 -m lapse.cli bench attention --seq-lens 4096 8192 16384 --tokens 32768 --heads 24 \
        --head-dim "$d" --providers sdpa-default lapse lapse-acp --graph-times \
        --out-dir "$OUT/$tag-attention-d$d" "${commit[@]}" 2>&1 | grep -E "^\| (sdpa|lapse)|^## |CUDA graph" | head -n 40
done
