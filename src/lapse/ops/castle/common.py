"""Shared pieces of CASTLE: the input checks every backend goes through.

SPEC section 5. Legend: B batch (or packed sequences), T length, H query heads (of both
``q_c`` and ``q_u``), HC heads of ``k_c, v_c``, HU heads of ``k_u, v_u``, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..backend import BACKENDS, check_backend
from ..forgetting.common import (
    _shape,
    check_cu_seqlens,
    check_devices,
    check_float_dtype,
    check_tensors,
    resolve_scale,
)

MAX_HEAD_DIM = 256
# "triton-parallel": the key-major Triton schedule (README.md), one launch per pass
# instead of the wavefront's 2 T / BT, what "auto" picks on CUDA (faster at every shape
# measured on an H100); "triton" is the wavefront (deterministic: no atomics).
CASTLE_BACKENDS = (*BACKENDS, "triton-parallel")


@dataclass(frozen=True)
class Problem:
    """Validated shapes of one ``castle_attention`` call."""

    batch: int
    t: int
    h: int  # heads of q_c and q_u
    hc: int  # heads of k_c, v_c
    hu: int  # heads of k_u, v_u
    d: int
    scale: float
    window: int | None  # None: CASTLE; an int >= 1: CASTLE-SWL
    seqlens: list[int] | None  # host copy of the packed lengths (cu_seqlens)


def check_window(window: object) -> int | None:
    """``None`` or an int >= 1 (the lookahead window of CASTLE-SWL)."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int):
        raise TypeError(f"window must be None or an int >= 1, got {window!r}")
    if window < 1:
        raise ValueError(f"window must be >= 1 (None for CASTLE without a window), got {window}")
    return window


def check_group(name: str, x: Tensor, h: int) -> None:
    """``x`` ``[B, T, HX, D]`` may have fewer heads than the queries when they divide them."""
    hx = x.shape[2]
    if hx < 1 or h % hx != 0:
        raise ValueError(
            f"{name} has {hx} heads, which must divide the {h} query heads (grouped-query)"
        )


def validate(
    q_c: Tensor,
    k_c: Tensor,
    v_c: Tensor,
    q_u: Tensor,
    k_u: Tensor,
    v_u: Tensor,
    scale: float | None,
    window: object,
    cu_seqlens: Tensor | None,
    backend: str,
) -> Problem:
    """Checks every argument of ``castle_attention``; raises before any work is done."""
    six = dict(q_c=q_c, k_c=k_c, v_c=v_c, q_u=q_u, k_u=k_u, v_u=v_u)
    check_tensors(**six)
    for name, t in six.items():
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, time, heads, head_dim], got {_shape(t)}")
        check_float_dtype(name, t)
    check_devices(q_c, **six)
    if len({t.dtype for t in six.values()}) != 1:
        raise TypeError(
            "q_c, k_c, v_c, q_u, k_u, v_u must share a dtype, got "
            + ", ".join(f"{n} {t.dtype}" for n, t in six.items())
        )
    b, t, h, d = q_c.shape
    for name, x in six.items():
        if x.shape[-1] != d:
            raise ValueError(f"{name} has head_dim {x.shape[-1]} but q_c has head_dim {d}")
        if x.shape[0] != b or x.shape[1] != t:
            raise ValueError(
                f"{name} is [batch, time] = {tuple(x.shape[:2])} but q_c is {(b, t)}: "
                "all six tensors cover the same tokens"
            )
    if q_u.shape != q_c.shape:
        raise ValueError(f"q_u must have the shape of q_c, got {_shape(q_u)} and {_shape(q_c)}")
    if k_c.shape != v_c.shape:
        raise ValueError(f"k_c and v_c must have the same shape, got {_shape(k_c)} and {_shape(v_c)}")
    if k_u.shape != v_u.shape:
        raise ValueError(f"k_u and v_u must have the same shape, got {_shape(k_u)} and {_shape(v_u)}")
    check_group("k_c", k_c, h)
    check_group("k_u", k_u, h)
    if d < 1 or d > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {d}")
    window = check_window(window)
    check_backend(backend, CASTLE_BACKENDS)
    scale = resolve_scale(scale, d)
    seqlens = None
    if cu_seqlens is not None:
        seqlens = check_cu_seqlens(cu_seqlens, q_c, "q_c", b, t)
    return Problem(b, t, h, k_c.shape[2], k_u.shape[2], d, scale, window, seqlens)
