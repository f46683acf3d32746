#!/usr/bin/env bash
# Issue 16, twentieth session: ACP's work around the kernels in fewer launches (the query and
# key norms in one, delta inside the boundary search, each key block's last kept query block in
# one kernel). The GPU tests of the op and of the new launches, then the same-process A/B
# against REV's boundary functions (carry ab_old: `python3 scripts/ab_acp_prologue.py --prepare
# REV` here), the op's profile, and lapse bench attention at D 64 and 128. Carry .whl and ab_old.
# Usage, from the repo root: COMMIT=<this tree> bash scripts/gpu.sh bash scripts/gpu_issue16_s20.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s20}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
commit=(); [[ -n "${COMMIT:-}" ]] && commit=(--commit "$COMMIT")
timeout 300 python3 -m pytest -q -m gpu tests/ops/test_forgetting_triton.py -p no:cacheprovider --tb=short \
    -k "test_triton_gpu" 2>&1 | grep -E "^(E |FAILED|ERROR)|passed|failed" | head -n 20
timeout 120 python3 -m pytest -q -m "not slow" tests/ops/test_forgetting_triton.py -p no:cacheprovider --tb=short \
    -k "folded or block_end_kernel or fused_acp" 2>&1 | grep -E "^(E |FAILED|ERROR)|passed|failed" | head -n 20
timeout 240 python3 scripts/ab_acp_prologue.py --out "$OUT/$tag-ab-acp-prologue.json" 2>&1 | tail -n 8
timeout 60 python3 scripts/diag_norm_parts.py --out "$OUT/$tag-norm-parts.json" 2>&1 | tail -n 20
timeout 90 python3 scripts/profile_fox_op.py --shapes 4096x64 4096x128 --out "$OUT/$tag-fox-op-profile.json" \
    2>&1 | tail -n 40
for d in 64 128; do
    timeout 120 python3 -m lapse.cli bench attention --seq-lens 4096 8192 16384 --tokens 32768 --heads 24 \
        --head-dim "$d" --providers sdpa-default lapse lapse-acp --out-dir "$OUT/$tag-attention-d$d" "${commit[@]}" \
        2>&1 | grep -E "^\| (sdpa|lapse)|^## " | head -n 20
done
