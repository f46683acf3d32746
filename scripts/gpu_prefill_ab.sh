#!/usr/bin/env bash
# The prefill of Hugging Face models through EvictingCache, several versions of lapse in one
# device call (scripts/diag_prefill_hf.py, timings only), in alternating rounds so that the
# host's speed, which moves between machines and over a call, weighs on each alike.
# VERSIONS: folders each holding a `lapse` package (e.g. `git archive <commit> src/lapse`
# unpacked under runs/ab/<commit>, carried); ROUNDS (default 2).
# Usage: bash scripts/gpu.sh bash scripts/gpu_prefill_ab.sh   (carry [".whl", "runs/ab"])
set -uo pipefail
export PYTHONUNBUFFERED=1
BASE="${OUT:-runs}"
mkdir -p "$BASE/prefill-ab"
VERSIONS="${VERSIONS:-$(ls -d runs/ab/*)}"
for round in $(seq "${ROUNDS:-2}"); do
    for dir in $VERSIONS; do
        name="$(basename "$dir")"
        echo "== round $round: $name"
        PYTHONPATH="$PWD/$dir" timeout 150 python3 scripts/diag_prefill_hf.py --no-profile \
            --out "$BASE/prefill-ab/$name-round$round.json" 2>&1 | grep -E "^(hf-|decoder-)"
    done
done
