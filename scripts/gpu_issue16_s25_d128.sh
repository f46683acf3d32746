#!/usr/bin/env bash
# Issue 16, twenty-fifth session: the D 128 ACP table's routed launch on the persistent Gluon
# kernel (GLUON_ACP="routed"): its GPU tests, then the op with and without it in one process
# (scripts/ab_gluon_acp.py), eager and from CUDA graphs.
# Usage: bash scripts/gpu.sh bash scripts/gpu_issue16_s25_d128.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s25-d128}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
if [[ -z "${NO_TESTS:-}" ]]; then
    timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/ops/test_forgetting_triton.py -k "gluon_acp" 2>&1 | tail -n 4
fi
timeout "${AB_TIMEOUT:-300}" python3 scripts/ab_gluon_acp.py ${AB_ARGS:-} --out "$OUT/$tag-ab-gluon-acp.json"
