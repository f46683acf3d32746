#!/usr/bin/env bash
# Issue 15's prefill target: where the prefill goes
# (scripts/diag_prefill_hf.py: timings, profiles and the calls that wait for the device, in
# prefill-diag.txt), then lapse's window and H2O at 10% against kvpress's
# StreamingLLM and SnapKV on a random SmolLM2-135M, 4 x 4096, in one run, each prefill timed 7 times
# (MODES=once,compiled: lapse's compiled decode loop after the same prefill too; then give
# DEADLINE and STOP room, e.g. 200 and 420).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue15_prefill.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
BASE="${OUT:-runs}"  # the device tool's folder that comes back, or runs/
OUT="$BASE/issue15-prefill"
mkdir -p "$OUT"
timeout 120 python3 scripts/diag_prefill_hf.py --out "$OUT/prefill-diag.json" 2>&1 | grep -v -i warn \
    | grep -E "^(hf-|decoder-)|Self (CPU|CUDA) time total|== |^/|^<"
OUT="$OUT/kvpress" SHAPES=smollm2-135m PROMPTS=4096 BUDGETS=0.1 MODES="${MODES:-once}" PREFILL_REPEATS=6 \
    DEADLINE="${DEADLINE:-70}" STOP="${STOP:-250}" \
    bash scripts/gpu_kvpress.sh 2>&1 | tail -n 22
# one file back (the device tool returns a few files per call), beside whatever else is there
cd "$BASE" && tar czf issue15-prefill.tgz issue15-prefill && rm -rf issue15-prefill
