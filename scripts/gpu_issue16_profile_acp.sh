#!/usr/bin/env bash
# Issue 16: Nsight Compute on the Triton FoX forward with ACP keeping 1, 4 and 16 blocks a row,
# and dense (D 64, T 4096): what a program with little work waits on (BENCHMARKS.md, "Fifteenth
# session"). Run: bash scripts/gpu.sh bash scripts/gpu_issue16_profile_acp.sh
set -uo pipefail
OUT="${OUT:-/tmp}"
SHAPE="${SHAPE:-4096x64}"
nvidia-smi --query-gpu=name --format=csv,noheader
NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
"$NCU" --version | tail -1
# launches: per window one warm-up, then the profiled one (every other _fwd_kernel launch)
"$NCU" --kernel-name regex:_fwd_kernel --launch-skip 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
    --section LaunchStats --section InstructionStats --section SourceCounters \
    python3 scripts/profile_fox_fwd.py --shape "$SHAPE" --acp-windows 1 16 0 > "$OUT/ncu-acp-$SHAPE.txt" 2>&1
echo "ncu rc $?"
grep -E "_fwd_kernel|Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Stall|stall" \
    "$OUT/ncu-acp-$SHAPE.txt" | head -120
