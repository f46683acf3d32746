#!/usr/bin/env bash
# Training throughput of this tree against an older one, alternating, on a fresh 125M FoX Pro
# (random tokens, ACP, compiled, T 16384): bench train in separate processes, old/new/old/new.
# Usage: OLD_SRC=runs/old/src bash scripts/gpu.sh bash scripts/gpu_train_ab_fresh.sh (carry runs/old)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/gpu}"
OLD_SRC="${OLD_SRC:?a copy of the older src/ folder}"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
for i in 1 2; do
    for tree in old new; do
        src="$PWD/src"
        [[ "$tree" == old ]] && src="$PWD/$OLD_SRC"
        echo "== round $i, $tree sources"
        PYTHONPATH="$src" timeout 200 python3 -m lapse.cli bench train --preset 125m --arch fox-pro \
            --seq-len 16384 --variants acp-compile --steps 8 --warmup 2 --out-dir "$OUT/fresh-$tree-$i" 2>&1 \
            | grep -E "^\| acp"
    done
done
