#!/usr/bin/env bash
# Issue 16, twenty-third session's first call: where an eager call's host time goes (cProfile,
# by function, both orders), then the bench with --graph-times (eager against CUDA-graph
# replays) at D 64 and D 128.
# Usage, from the repo root: COMMIT=<tree> bash scripts/gpu.sh bash scripts/gpu_issue16_s23_first.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s23-first}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
for sort in tottime cumulative; do
    timeout 120 python3 scripts/diag_op_cprofile.py --top 45 --sort "$sort" > "$OUT/cprofile-$sort.txt" 2>&1
done
grep "===" "$OUT/cprofile-tottime.txt"
OUT="$OUT" bash scripts/gpu_issue16_graph_times.sh
