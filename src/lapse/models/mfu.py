"""Model FLOPs utilisation: achieved model FLOP/s over the devices' peak.

The model side is :func:`lapse.models.flops_per_token`; this module holds the other side,
the peak of a device, which the trainer and the training benchmark both report against.
"""

from __future__ import annotations

import torch

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) by a substring of the device name.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "L40S": 362.0, "4090": 165.0}


def peak_tflops(device: torch.device, override: float | None = None) -> float | None:
    """Peak bf16 TFLOP/s of ``device`` for MFU; ``None`` when unknown (CPU, other GPUs)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


__all__ = ["PEAK_TFLOPS", "peak_tflops"]
