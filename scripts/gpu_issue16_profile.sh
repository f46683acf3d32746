#!/usr/bin/env bash
# Issue 16: Nsight Compute on the Triton and the Gluon FoX forward (D 64, T 4096), the
# sections that say what the warps wait on. With ACP_WINDOWS="1 16 0": the Triton forward
# with ACP keeping about W blocks a row instead, per W (0: dense; profile_fox_fwd.py
# --acp-windows), every launch after the first warm-up one.
# Run: bash scripts/gpu.sh bash scripts/gpu_issue16_profile.sh
set -uo pipefail
OUT="${OUT:-/tmp}"
SHAPE="${SHAPE:-4096x64}"
ACP_WINDOWS="${ACP_WINDOWS:-}"
nvidia-smi --query-gpu=name --format=csv,noheader
NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
"$NCU" --version | tail -1
if [[ -n "$ACP_WINDOWS" ]]; then
    # shellcheck disable=SC2086  # the windows are words
    "$NCU" --kernel-name regex:_fwd_kernel --launch-skip 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section LaunchStats --section InstructionStats --section SourceCounters \
        python3 scripts/profile_fox_fwd.py --shape "$SHAPE" --acp-windows $ACP_WINDOWS > "$OUT/ncu-acp-$SHAPE.txt" 2>&1
    echo "ncu rc $?"
    grep -E "_fwd_kernel|Duration|Registers Per|Achieved Occupancy|Issued Warp|No Eligible|Warp Cycles Per Issued|Executed Instructions  " \
        "$OUT/ncu-acp-$SHAPE.txt" | head -120
    exit 0
fi
"$NCU" --kernel-name regex:_fwd_kernel --launch-skip 1 --launch-count 3 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
    --section SchedulerStats --section Occupancy --section LaunchStats --section InstructionStats \
    python3 scripts/profile_fox_fwd.py --shape "$SHAPE" > "$OUT/ncu-$SHAPE.txt" 2>&1
echo "ncu rc $?"
grep -E "_fwd_kernel|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|Eligible Warps|No Eligible|Warp Cycles Per Issued|Executed Ipc A|Block Limit Reg|Block Limit Shared|Stall" "$OUT/ncu-$SHAPE.txt" | head -80
