#!/usr/bin/env bash
# The main job: set-up, then `lapse train cpu-small`: a small FoX (Pro) with ACP trained on
# the local Python installation's source files (read as bytes) for about 5 minutes on a
# 2-core CPU, then `lapse generate` from the trained model with ACP eviction (the keys its
# forget gates have decayed below ACP's threshold leave the KV store for good). It writes
# a run folder runs/cpu-small-<date>-<time>/ with the checkpoint, metrics.jsonl, loss.png
# and report.md, and ends with generation's line: tokens/s and the KV bytes held against
# a dense cache. Extra arguments override preset fields (e.g. `bash scripts/main.sh
# --steps 100`; see `python -m lapse.cli train cpu-small --help`); an architecture without
# QK-norm and a forget gate generates with a sinks + window policy instead. Ctrl-C stops
# training with a checkpoint; continue with `python -m lapse.cli resume RUN_DIR`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# `python -m lapse.cli` is the `lapse` command, and works where pip's script folder is
# not on PATH.
PY="${PYTHON:-python3}"
RUN="runs/cpu-small-$(date +%Y%m%d-%H%M%S)"
"$PY" -m lapse.cli train cpu-small --run-dir "$RUN" "$@"
POLICY=acp
"$PY" - "$RUN" <<'PYEOF' || POLICY=window
import sys
from lapse.generation import ACPBoundary
from lapse.generation.command import load_run_model
ACPBoundary().check(load_run_model(__import__("pathlib").Path(sys.argv[1]), "cpu")[0])
PYEOF
echo
echo "generating from $RUN with the $POLICY policy:"
exec "$PY" -m lapse.cli generate "$RUN" --prompt "def " --max-new-tokens 400 --policy "$POLICY" --every 16
