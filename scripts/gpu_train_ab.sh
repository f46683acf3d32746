#!/usr/bin/env bash
# Training throughput, this tree against an older one on the same checkpoint and machine (issue 16,
# item 4): gpu_train_125m.sh (125M FoX Pro + ACP at T 16384 for TRAIN_MINUTES, then bench train
# with this tree), then bench train of acp-compile with the older sources in $OLD_SRC (a copy of an
# older commit's src/, carried), then this tree's again. Usage, from the repo root:
#   git archive <commit> src | tar -x -C runs/old && OLD_SRC=runs/old/src \
#       bash scripts/gpu.sh bash scripts/gpu_train_ab.sh        (carry runs/old and .whl)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/gpu}"
OLD_SRC="${OLD_SRC:?a copy of the older src/ folder}"
SKIP_TINY=1 VARIANTS="${VARIANTS:-acp-compile transformer-compile}" bash scripts/gpu_train_125m.sh
for tree in old new; do
    src="$PWD/src"
    [[ "$tree" == old ]] && src="$PWD/$OLD_SRC"
    echo "== bench train, acp-compile, $tree sources ($src)"
    PYTHONPATH="$src" python3 -m lapse.cli bench train --run /tmp/r125 --variants acp-compile \
        --steps 4 --warmup 2 --out-dir "$OUT/bench-$tree" 2>&1 | grep -E "^\| (acp|transformer)"
done
