#!/usr/bin/env bash
# The main job: set-up, then `lapse demo` (forgetting attention with and without ACP on a
# small CPU problem, checked against the naive reference; results in runs/demo/).
# It stands in for training until the training issue lands. Extra arguments go to the
# demo (e.g. `bash scripts/main.sh --seq-len 2048`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# `python -m lapse.cli` is the `lapse` command, and works where pip's script folder is
# not on PATH.
exec "${PYTHON:-python3}" -m lapse.cli demo "$@"
