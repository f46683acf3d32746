#!/usr/bin/env bash
# Issue 16: lapse bench attention with --graph-times (written in the twenty-second session after
# its last GPU call): each provider eagerly and replayed from a CUDA graph, so the eager ACP
# forward+backward at 4k can be told apart from the host's launches. First the bench's CPU
# tests of the graph path, then D 64 and D 128 at 4k / 8k / 16k.
# Usage, from the repo root: COMMIT=<this tree> bash scripts/gpu.sh bash scripts/gpu_issue16_graph_times.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-graph-times}"
mkdir -p "$OUT"
GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
echo "$GPU"
tag="$(echo "$GPU" | grep -oiE "h100|h200" | tr A-Z a-z)"
commit=(); [[ -n "${COMMIT:-}" ]] && commit=(--commit "$COMMIT")
timeout 120 python3 -m pytest -q tests/bench/test_attention_baselines.py -p no:cacheprovider 2>&1 | tail -n 2
for d in ${BENCH_DIMS:-64 128}; do
    timeout 280 python3 -m lapse.cli bench attention --seq-lens 4096 8192 16384 --tokens 32768 --heads 24 \
        --head-dim "$d" --providers sdpa-default lapse lapse-acp --graph-times \
        --out-dir "$OUT/$tag-attention-d$d" "${commit[@]}" 2>&1 | grep -E "^\| (sdpa|lapse)|^## |CUDA graph" | head -n 40
done
