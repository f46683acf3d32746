"""What every op shares: the backend names, whether Triton can run, kernel constants.

Every public op takes ``backend="auto" | "triton" | "torch" | "naive"``: ``"auto"`` is
Triton for CUDA tensors and the PyTorch path otherwise.
Triton is optional; the PyTorch paths work without it.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: the torch backends work without it
    triton = tl = None

BACKENDS = ("auto", "triton", "torch", "naive")

# Kernels run the softmax in base 2: exp(x) = exp2(x * LOG2E), log(x) = log2(x) * LN2.
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# The same constants for @triton.jit code, which may read a global only when it is a
# tl.constexpr (plain floats without Triton, where no kernel is compiled).
LOG2E_TL = tl.constexpr(LOG2E) if tl is not None else LOG2E
LN2_TL = tl.constexpr(LN2) if tl is not None else LN2


def resolve_device(name: str | torch.device) -> torch.device:
    """The device a ``--device`` value names: ``"auto"`` is CUDA where a GPU is visible, else
    the CPU. Raises a one-line ``ValueError`` for a name torch does not know and for a CUDA
    device this machine does not have, before any model is built on it."""
    if isinstance(name, torch.device):
        dev = name
    elif name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            dev = torch.device(name)
        except (RuntimeError, TypeError):
            raise ValueError(f"unknown device {name!r} (auto, cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(name)!r}: no CUDA GPU is visible (pass --device cpu or auto)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(name)!r}: only {torch.cuda.device_count()} CUDA GPU(s) visible")
    return dev


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cuda_capability(x: Tensor) -> tuple[int, int]:
    """The compute capability of CUDA tensor ``x``'s device, cached by device (the query costs
    about 13 us of host time, and the kernels' launches ask it at every call)."""
    return _capability(x.device.index)


def triton_jit(fn):
    """``triton.jit``, or the plain function without Triton (so a module that defines
    kernels still imports; its torch path never calls them)."""
    return triton.jit(fn) if triton is not None else fn


def triton_usable(x: Tensor) -> bool:
    """Triton can run on ``x``: it is installed, and ``x`` is a CUDA tensor or the
    interpreter is on (``TRITON_INTERPRET=1``, CPU tensors; tests only)."""
    return triton is not None and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def check_backend(backend: str, allowed: tuple[str, ...] = BACKENDS) -> None:
    """Raises ``ValueError`` unless ``backend`` is one of ``allowed``."""
    if backend not in allowed:
        raise ValueError(f"backend must be one of {allowed}, got {backend!r}")


def resolve_backend(backend: str, x: Tensor, allowed: tuple[str, ...] = BACKENDS,
                    products: bool = True) -> str:
    """The backend to run for inputs like ``x``: ``"auto"`` becomes ``"triton"`` for CUDA
    tensors and ``"torch"`` otherwise; Triton is checked to be usable for ``x``.

    Raises ``ValueError`` for an unknown name or an unusable Triton, ``TypeError`` for
    float64 on Triton (its kernels take float16, bfloat16 and float32) and, where the kernels
    multiply tiles (``products``), for bfloat16 on the CPU interpreter.
    """
    check_backend(backend, allowed)
    if backend == "auto":
        backend = "triton" if x.is_cuda else "torch"
    if backend == "triton":
        if triton is None:
            raise ValueError("backend='triton' needs the triton package")
        if not triton_usable(x):
            raise ValueError(
                f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1), got {x.device}"
            )
        if x.dtype == torch.float64:
            raise TypeError("backend='triton' takes float16, bfloat16 or float32, got float64")
        if products and x.dtype == torch.bfloat16 and not x.is_cuda:
            # Triton 3.6's interpreter multiplies bfloat16 tiles wrongly (a 16 x 16 tl.dot is off
            # by ~1e10; float16 is exact), so its results would be garbage
            raise TypeError("backend='triton' on the CPU interpreter takes float16 or float32 (its bfloat16 "
                            "products are wrong); use backend='torch' for bfloat16 on the CPU")
    return backend


AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


def autocast_off(x: Tensor) -> contextlib.AbstractContextManager:
    """A block in which ``torch.autocast`` is off for ``x``'s device.

    The ops compute in the dtypes of their inputs and accumulate in float32, whatever an
    enclosing autocast says: under it their internal matmuls would come out in its low
    dtype (16-bit products written into float32 accumulators, or refused by in-place
    ops that need one dtype) and outputs would leave in a dtype other than the documented
    one. A model under autocast still gets its low precision in attention: its autocast
    projections hand the ops 16-bit ``q, k, v``. The autograd Functions' backwards use it
    too (:func:`autocast_off_backward`).
    """
    # a fixed list, not torch.amp.is_autocast_available: Dynamo cannot trace that builtin,
    # and a graph break here would split every compiled layer's graph at its attention
    if x.device.type not in AUTOCAST_DEVICES:  # e.g. "meta"
        return contextlib.nullcontext()
    return torch.autocast(x.device.type, enabled=False)


def autocast_off_backward(backward):
    """An autograd Function's ``backward`` under :func:`autocast_off` for its gradients'
    device: a backward called inside an autocast block would run under it."""

    @functools.wraps(backward)
    def run(ctx, *grads):
        given = [g for g in grads if g is not None]
        if not given:  # no device to take; on all-zero gradients autocast changes nothing
            return backward(ctx, *grads)
        with autocast_off(given[0]):
            return backward(ctx, *grads)

    return run


def tma_ready(*xs) -> bool:
    """Whether the tensor-memory engine can read these [B, T, H, D] tensors: every row
    start 16-byte aligned (base, batch, time and head strides) and unit stride in D."""
    return all(
        x.stride(-1) == 1 and x.data_ptr() % 16 == 0
        and all(st * x.element_size() % 16 == 0 for st in x.stride()[:-1])
        for x in xs
    )
