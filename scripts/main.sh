#!/usr/bin/env bash
# The main job: set-up, then `lapse train cpu-small`: a small FoX (Pro) with ACP trained on
# the local Python installation's source files (read as bytes) for about 5 minutes on a
# 2-core CPU. It writes a run folder runs/cpu-small-fox-pro-<date>-<time>/ with the
# checkpoint, metrics.jsonl, loss.png and report.md. Extra arguments override preset
# fields (e.g. `bash scripts/main.sh --steps 100 --model.arch fox-llama`; see
# `python -m lapse.cli train cpu-small --help`). Ctrl-C stops with a checkpoint; continue
# with `python -m lapse.cli resume RUN_DIR`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# `python -m lapse.cli` is the `lapse` command, and works where pip's script folder is
# not on PATH.
exec "${PYTHON:-python3}" -m lapse.cli train cpu-small "$@"
