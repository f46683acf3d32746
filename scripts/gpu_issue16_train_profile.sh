#!/usr/bin/env bash
# Issue 16, item 4: where a compiled 125M training step at T 16384 goes (torch.profiler, CUDA
# time by op), FoX Pro with ACP beside the Transformer Pro (SDPA's default backend).
# Usage, from the repo root: bash scripts/gpu.sh bash scripts/gpu_issue16_train_profile.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-train-profile}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null || true
timeout 250 python3 scripts/gpu_profile_train.py --preset 125m --arch fox-pro --seq-len 16384 --compile --acp \
    --top 40 > "$OUT/profile-fox-pro-acp.txt" 2>&1
timeout 250 python3 scripts/gpu_profile_train.py --preset 125m --arch transformer-pro --seq-len 16384 --compile \
    --top 40 > "$OUT/profile-transformer-pro.txt" 2>&1
for f in "$OUT"/profile-*.txt; do grep -vi warn "$f" | cut -c1-60,100-200 | head -n 30; done
