#!/usr/bin/env bash
# Every evaluation on two CPU-trained models, then one report: the pictures in the README
# and docs/eval/. The runs come from the main job and its Transformer twin:
#   bash scripts/main.sh --run-dir runs/cpu-small-fox-pro
#   python -m lapse.cli train cpu-small --model.arch transformer-pro --model.no-acp \
#       --run-dir runs/cpu-small-transformer-pro
# then: bash scripts/eval_cpu_small.sh   (about 5 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
FOX="${FOX:-runs/cpu-small-fox-pro}"
TR="${TR:-runs/cpu-small-transformer-pro}"
L="${PYTHON:-python3} -m lapse.cli"
# --overwrite: a second run of this script replaces the first's evaluations
$L eval per-token-loss --models "$FOX" "$TR" --names fox-pro transformer-pro --seq-len 512 --num-sequences 64 \
    --overwrite
$L eval ppl --models "$FOX" "$TR" --names fox-pro transformer-pro --context-lengths 128 256 512 1024 2048 \
    --num-sequences 16 --overwrite
$L eval niah --models "$FOX" "$TR" --context-lengths 256 512 1024 --depths 0 0.25 0.5 0.75 1 --trials 4 \
    --overwrite
$L eval acp --model "$FOX" --num-sequences 8 --overwrite
for run in "$FOX" "$TR"; do
    $L eval lm-eval --model "$run" --tasks lapse_tiny --no-log-samples --overwrite
done
# A copy without checkpoints under docs/eval/runs/, and the report over it.
for run in "$FOX" "$TR"; do
    dst="docs/eval/runs/$(basename "$run")"
    rm -rf "$dst" && mkdir -p "$dst"
    cp "$run"/{report.md,summary.json,metrics.jsonl,loss.png,config.json} "$dst/"
    cp -r "$run/eval" "$dst/"
done
$L report "docs/eval/runs/$(basename "$FOX")" "docs/eval/runs/$(basename "$TR")" --out docs/eval/report.md \
    --title "FoX (Pro) vs Transformer (Pro), small, trained 5 minutes on a 2-core CPU"
