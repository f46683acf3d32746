#!/usr/bin/env bash
# Issue 16, twenty-fifth session, first call: the package's GPU tests the last session's limit cut
# off (lm_loss, the two hf files, bench training, the CLI's bench smoke test, scores), then item 4's
# training table for SIZES (default 125m) at the current kernels (gpu_issue16_s19_table.sh).
# Usage: COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu.sh bash scripts/gpu_issue16_s25_first.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 \
    tests/models/test_lm_loss.py tests/hf/test_hf_generate.py tests/hf/test_evicting_cache.py \
    tests/bench/test_training.py tests/test_cli.py tests/ops/test_scores.py 2>&1 | tail -n 12
OUT="${OUT:-runs/issue16-s25-table}" SIZES="${SIZES:-125m}" bash scripts/gpu_issue16_s19_table.sh
