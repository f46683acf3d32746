#!/usr/bin/env bash
# Issue 16, item 4, nineteenth session: the trainer with CUDA-graphed blocks (--cuda-graphs).
# STAGE=1: its GPU test, then gpu_train_125m.sh's 125M FoX Pro + ACP at 16k for TRAIN_MINUTES
# with --cuda-graphs (the trainer's own tokens/s). STAGE=2, on the still-warm machine: bench
# train on that checkpoint, compiled against CUDA graphs, ACP and the Transformer, one row a
# forward. Carry .whl. Usage: STAGE=1 bash scripts/gpu.sh bash scripts/gpu_issue16_s19_train.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s19-train}"
mkdir -p "$OUT"
if [[ "${STAGE:-1}" == 1 ]]; then
    timeout 200 python3 -m pytest -q -s -m gpu tests/train/test_trainer_gpu.py -p no:cacheprovider --tb=short 2>&1 \
        | tee "$OUT/pytest.log" | grep -E "^(E |FAILED|ERROR)|passed|failed|^(train|val|acp) " | head -n 20
    SKIP_TINY=1 TRAIN_MINUTES="${TRAIN_MINUTES:-3}" TRAIN_EXTRA="--cuda-graphs" VARIANTS="" \
        bash scripts/gpu_train_125m.sh 2>&1 | grep -E "^==|train wall|pruned|tokens/s|Error|error" | head -n 30
    tail -n 3 /tmp/r125/metrics.jsonl
else
    timeout 560 python3 -m lapse.cli bench train --run /tmp/r125 \
        --variants acp-compile acp-cudagraphs transformer-compile transformer-cudagraphs --steps 5 --warmup 2 \
        --out-dir "$OUT/bench-micro1" 2>&1 | grep -E "^\| |Error|error"
fi
