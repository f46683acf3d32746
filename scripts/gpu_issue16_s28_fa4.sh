#!/usr/bin/env bash
# Issue 16, twenty-eighth session: FlashAttention-4 on the lent GPU. Its CuTe DSL compiler's
# wheel (nvidia-cutlass-dsl-libs-cu13, 92 MB) is over what one call carries, so it travels
# unpacked and xz-compressed in two parts: an earlier call on the same warm machine left the
# first in /tmp/fa4parts (`mkdir -p /tmp/fa4parts && cp .fa4a/part.* /tmp/fa4parts/`), and this
# call carries the second and the small wheels in .fa4b/ (both made here by scripts/fetch_fa4.sh).
# Then: scripts/check_fa4.py (does it run, and compute causal attention), then lapse bench
# attention with it beside SDPA's default. Usage, carry .fa4b, not through gpu.sh (it needs .whl):
#   COMMIT=<tree> bash scripts/gpu_issue16_s28_fa4.sh
# Options: NO_CHECK=1, GPU_TESTS="<pytest paths>" (-m gpu, first), DIMS, SEQ_LENS, PROVIDERS
# (beside sdpa-default and flash-attn-4; default lapse lapse-acp), MODES, BENCH_TIMEOUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s28-fa4}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
tag="${tag:-gpu}"  # another GPU: its files still get a name
source scripts/fa4_env.sh || exit 1
[[ -n "${GPU_TESTS:-}" ]] && timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider $GPU_TESTS 2>&1 | tail -n 5
[[ -z "${NO_CHECK:-}" ]] && timeout "${CHECK_TIMEOUT:-300}" python3 scripts/check_fa4.py --out "$OUT/$tag-check-fa4.json" ${CASES:+--cases $CASES} 2>&1 | tail -n 30
commit=(); [[ -n "${COMMIT:-}" ]] && commit=(--commit "$COMMIT")
for d in ${DIMS:-64 128}; do
    timeout "${BENCH_TIMEOUT:-250}" python3 -m lapse.cli bench attention --seq-lens ${SEQ_LENS:-4096 8192 16384} \
        --tokens 32768 --heads 24 --head-dim "$d" --providers sdpa-default flash-attn-4 ${PROVIDERS:-lapse lapse-acp} ${MODES:+--modes $MODES} \
        --graph-times --out-dir "$OUT/$tag-attention-d$d" "${commit[@]}" 2>&1 \
        | grep -E "^\| (sdpa|lapse|flash|flex)|^## |CUDA graph|flash-attn-4|flex-flash|Error|error" | head -n 40
done
