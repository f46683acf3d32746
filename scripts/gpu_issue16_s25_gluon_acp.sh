#!/usr/bin/env bash
# Issue 16, twenty-fifth session: the persistent Gluon ACP forward (gluon_fwd.launch_acp) checked
# against the Triton ACP forward and timed (scripts/diag_gluon_acp.py); then the two GPU tests the
# first call's limit cut off (the CLI's bench smoke test, scores).
# Usage: bash scripts/gpu.sh bash scripts/gpu_issue16_s25_gluon_acp.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s25-gluon-acp}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
timeout "${DIAG_TIMEOUT:-330}" python3 scripts/diag_gluon_acp.py ${DIAG_ARGS:-} --out "$OUT/$tag-gluon-acp.json"
echo "diag rc $?"
if [[ -z "${NO_TESTS:-}" ]]; then
    timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 \
        tests/test_cli.py tests/ops/test_scores.py 2>&1 | tail -n 12
fi
