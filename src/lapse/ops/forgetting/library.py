"""The Triton path of forgetting attention as ``torch.library`` custom ops, for torch.compile.

``torch.compile`` cannot trace the Triton kernels themselves (Inductor re-compiles user
Triton kernels and fails on the forward kernel's nested ``@triton.jit`` helpers: Triton
3.6, torch 2.11), so a layer that called :func:`forgetting_attention` from a compiled block
broke the graph there. Dynamo splits every enclosing frame at such a break: a FoX block
became five compiled graphs, each with its own guards and autograd wrapper on the host, in
the forward and again in the backward. These ops are opaque to the compiler (it calls them,
knowing only their output shapes), so a block stays one graph. The layers take them while
compiling (:func:`compiled_forgetting_attention`); eager calls keep the public op.

Two ops: ``lapse::fox_forward`` (the gate's cumulative sum, the ACP boundary search and
the forward kernel; it returns what the backward needs) and ``lapse::fox_backward`` (both
backward kernels and the gate's gradient), joined by ``register_autograd``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .common import ACP_BLOCK, LOG_GATE_FLOOR, resolve_scale, validate

# the Triton modules are imported by the ops' bodies: lapse imports without Triton installed


@torch.library.custom_op("lapse::fox_forward", mutates_args=())
def fox_forward(
    q: Tensor, k: Tensor, v: Tensor, log_fgate: Tensor, scale: float, bound: Tensor | None,
    auto_bound: bool, acp_eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(o, lse2, c_hi, c_lo, block_start)``: the output, the base-2 lse and the cumulative
    gate ``[B, HQ, Tc]``, the ACP block starts ``[B, HQ, ceil(Tq / 64)]`` int32 (empty
    without ACP). ACP: ``auto_bound`` (the bound from the data), else ``bound`` (``[HQ]`` or
    ``[B, HQ]``), else none."""
    from .pruning import triton_acp_block_start
    from .triton_ops import forward_kernel, triton_gate_cumsum

    p = validate(q, k, v, log_fgate, scale, None, "triton")
    acp = "auto" if auto_bound else bound
    with torch.no_grad():
        c_hi, c_lo = triton_gate_cumsum(log_fgate, p)
        block_start = None if acp is None else triton_acp_block_start(acp, acp_eps, q, k, c_hi, c_lo, p)
        o, lse2 = forward_kernel(q, k, v, c_hi, c_lo, p, block_start)
    if block_start is None:
        block_start = torch.empty(0, dtype=torch.int32, device=q.device)
    return o, lse2, c_hi, c_lo, block_start


@fox_forward.register_fake
def _(q, k, v, log_fgate, scale, bound, auto_bound, acp_eps):
    b, tq, hq, _ = q.shape
    tc = log_fgate.shape[1]
    rows = q.new_empty(b, hq, tc, dtype=torch.float32)
    starts = (b, hq, -(-tq // ACP_BLOCK)) if auto_bound or bound is not None else (0,)
    return (torch.empty_like(q), rows, torch.empty_like(rows), torch.empty_like(rows),
            q.new_empty(starts, dtype=torch.int32))


@torch.library.custom_op("lapse::fox_backward", mutates_args=())
def fox_backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse2: Tensor, c_hi: Tensor,
    c_lo: Tensor, log_fgate: Tensor, block_start: Tensor, scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, d log_fgate)`` from the output gradient ``do`` and the forward's
    saved tensors (``block_start`` empty without ACP)."""
    from .gate_scan import gate_grad
    from .triton_ops import backward_kernels

    p = validate(q, k, v, log_fgate, scale, None, "triton")
    with torch.no_grad():
        dq, dk, dv, dcc, dcr = backward_kernels(
            q, k, v, o, do, lse2, None, c_hi, c_lo, block_start if block_start.numel() else None, p
        )
        return dq, dk, dv, gate_grad(dcc, dcr, log_fgate, p, LOG_GATE_FLOOR)


@fox_backward.register_fake
def _(do, q, k, v, o, lse2, c_hi, c_lo, log_fgate, block_start, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(log_fgate)


def _setup_context(ctx, inputs, output):
    q, k, v, log_fgate, scale, *_ = inputs
    o, lse2, c_hi, c_lo, block_start = output
    ctx.save_for_backward(q, k, v, o, lse2, c_hi, c_lo, log_fgate, block_start)
    ctx.scale = scale


def _backward(ctx, do, *_):
    q, k, v, o, lse2, c_hi, c_lo, log_fgate, block_start = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv, dlog = fox_backward(do.contiguous(), q, k, v, o, lse2, c_hi, c_lo, log_fgate,
                                    block_start, ctx.scale)
    return dq, dk, dv, dlog, None, None, None, None


fox_forward.register_autograd(_backward, setup_context=_setup_context)


def compiled_forgetting_attention(
    q: Tensor, k: Tensor, v: Tensor, log_fgate: Tensor, *, scale: float | None = None,
    acp: None | str | Tensor = None, acp_eps: float = math.exp(-10),
) -> Tensor:
    """:func:`forgetting_attention`'s output through the custom ops (Triton backend, no
    packed sequences, no lse or statistics): what a compiled layer calls. ``acp`` as there,
    but a bound must be ``"auto"`` or a tensor."""
    if not (acp is None or isinstance(acp, Tensor) or acp == "auto"):
        raise ValueError(f"acp must be None, 'auto' or a tensor here, got {acp!r}")
    bound = acp if isinstance(acp, Tensor) else None
    o, *_ = fox_forward(q, k, v, log_fgate, resolve_scale(scale, q.shape[-1]), bound, isinstance(acp, str),
                        float(acp_eps))
    return o
