"""Constants the DCP paths share (torch, Triton and the mask)."""

from __future__ import annotations

import math

import torch

# log Ibar and log I are floored here instead of reaching -inf: a cumulative sum through
# -inf is fine, but any later difference or product with 0 would give NaN, and a floored
# weight exp(-1e4) is exactly 0 in float32 and float64, the same as the -inf it stands for.
LOG_FLOOR = -1.0e4
T_MAX = -LOG_FLOOR

# Bisection halves [0, T_MAX] until the bracket is below half an ulp of 1/2 (the scale of
# p where it is most sensitive to t): ceil(log2(T_MAX) + mantissa bits). float32: 38
# steps (|t error| <= 3.6e-8); float64: 67 steps (|t error| <= 6.8e-17).
STEPS = {
    torch.float32: math.ceil(math.log2(T_MAX) + 24),
    torch.float64: math.ceil(math.log2(T_MAX) + 53),
}
