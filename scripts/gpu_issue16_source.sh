#!/usr/bin/env bash
# Issue 16: where the ACP forward's programs stall, by source line and SASS instruction
# (Nsight Compute's warp-state samples), at a kept window of 1 block (D 64, T 4096): what a
# program that does little work waits on (BENCHMARKS.md, "Fifteenth session").
# Run: bash scripts/gpu.sh bash scripts/gpu_issue16_source.sh
set -uo pipefail
OUT="${OUT:-/tmp}"
SHAPE="${SHAPE:-4096x64}"
WINDOW="${WINDOW:-1}"
NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
"$NCU" --kernel-name regex:_fwd_kernel --launch-skip 1 --launch-count 1 --import-source yes \
    --section SourceCounters --section WarpStateStats -f -o "$OUT/fwd-w$WINDOW" \
    python3 scripts/profile_fox_fwd.py --shape "$SHAPE" --acp-windows "$WINDOW" > "$OUT/ncu-log.txt" 2>&1
echo "ncu rc $?"
"$NCU" -i "$OUT/fwd-w$WINDOW.ncu-rep" --page source --csv --print-source sass > "$OUT/fwd-w$WINDOW-sass.csv" 2>&1
"$NCU" -i "$OUT/fwd-w$WINDOW.ncu-rep" --page source --csv --print-source cuda > "$OUT/fwd-w$WINDOW-cuda.csv" 2>&1
"$NCU" -i "$OUT/fwd-w$WINDOW.ncu-rep" --page details --print-details all > "$OUT/fwd-w$WINDOW-details.txt" 2>&1
wc -c "$OUT"/fwd-w"$WINDOW"*
head -c 1500 "$OUT/fwd-w$WINDOW-sass.csv"
