#!/usr/bin/env bash
# Issue 16: Nsight Compute on the Triton and the Gluon FoX forward (D 64, T 4096), the
# sections that say what the warps wait on. Run: bash scripts/gpu.sh bash scripts/gpu_issue16_profile.sh
set -uo pipefail
OUT="${OUT:-/tmp}"
SHAPE="${SHAPE:-4096x64}"
nvidia-smi --query-gpu=name --format=csv,noheader
NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
"$NCU" --version | tail -1
"$NCU" --kernel-name regex:_fwd_kernel --launch-skip 1 --launch-count 3 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
    --section SchedulerStats --section Occupancy --section LaunchStats --section InstructionStats \
    python3 scripts/profile_fox_fwd.py --shape "$SHAPE" > "$OUT/ncu-$SHAPE.txt" 2>&1
echo "ncu rc $?"
grep -E "_fwd_kernel|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|Eligible Warps|No Eligible|Warp Cycles Per Issued|Executed Ipc A|Block Limit Reg|Block Limit Shared|Stall" "$OUT/ncu-$SHAPE.txt" | head -80
