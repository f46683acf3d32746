"""``lapse bench attention``: every attention provider, one process, the same inputs.

Providers (``--providers``):

- ``lapse``: ``forgetting_attention(..., backend="triton")``, dense.
- ``lapse-acp``: the same with ACP (``acp="auto"``, i.e. ``U`` from the largest query and
  key norms, or ``--acp-bound qk-norm``: ``U = D * scale`` known from QK-norm, times the
  rounding factor of ``qk_norm_bound``), eps e^-10.
- ``sdpa-default``, ``sdpa-flash``, ``sdpa-efficient``, ``sdpa-cudnn``: PyTorch SDPA,
  causal, *no gate*, with PyTorch's own backend choice (what a Transformer user gets; the
  notes name the kernel that ran, cuDNN on an H100 with torch 2.11) or forced to one
  backend (FlashAttention-2, memory-efficient, cuDNN). A backend that refuses the shapes or
  the device is reported n/a with SDPA's reason. Inputs are transposed to ``[B, H, T, D]``
  outside the timed region; varlen uses ``torch.nn.attention.varlen.varlen_attn``, which
  has no backend choice, so only ``sdpa-default`` and ``sdpa-flash`` run there. ``sdpa``
  is an alias of ``sdpa-flash`` (its older name).
- ``flash-attn-4``: FlashAttention-4's CuTe DSL kernels (``flash_attn.cute`` of the
  ``flash-attn-4`` package, Hopper and Blackwell), causal, *no gate*, in lapse's own ``[B, T,
  H, D]`` layout, grouped K/V natively, packed sequences through its varlen entry; reported
  n/a where it is not importable or cannot run (CUDA only). Not a dependency of lapse: it
  needs the CuTe DSL compiler (``nvidia-cutlass-dsl``); its first call compiles, outside
  the timed region. (``flash-attn`` 2.x has no binary wheel in the package registry.)
- ``flash-attn-4-acp``: the same kernels with FlashAttention-4's block sparsity on exactly the
  tiles ``lapse-acp`` visits (its forward's key tiles and its backward's query tiles, from the
  same boundaries), *no gate*: what the fastest block-sparse attention keeps of its speed on
  ACP's tiles, the peer of ``lapse-acp``'s efficiency (its own against ``flash-attn-4``). The
  tile lists are made outside the timed call (``lapse-acp`` times its bound and lists); Hopper
  only (the lists follow FlashAttention-4's sm90 tiles), no varlen. A timing peer: without a
  gate the keys it skips carry weight, and its backward works on its own tiles (those holding
  a pair ACP keeps), so its gradients are not its output's (the GPU test states what it computes).
- ``flex``: FlexAttention (compiled) with the decay ``score_mod``
  ``score + c[b, h, q] - c[b, h, kv]``, ``c`` the float32 cumulative sum of the log gates
  (computed inside the timed region), causal (and per-document) block mask.
- ``flex-flash`` (not in the default list): the same FlexAttention through its
  ``BACKEND="FLASH"`` kernels, FlashAttention-4's CuTe DSL (``flash-attn-4`` installed,
  CUDA). torch's flash backward takes no gradient for a tensor the score_mod reads, so its
  forward+backward reports the error (the gates need one).
- ``fla``: flash-linear-attention's ``parallel_forgetting_attn`` (``fla.ops.forgetting_attn``),
  when importable.

CASTLE providers (SPEC section 5; not in the default list, name them with ``--providers``):
the workload's ``q, k, v`` are CASTLE's causal ``Q^C, K^C, V^C``, and lookahead ``Q^U,
K^U, V^U`` are drawn like them (``q, k`` RMS-normalised, ``v ~ N(0, 1)``, seed + 2):

- ``castle-triton``, ``castle-torch``, ``castle-naive``:
  ``lapse.ops.castle_attention(..., backend=...)``; ``naive`` materialises Theorem 1
  (O(T^3) time, several ``T x T`` buffers per head), so it is skipped (reported n/a)
  above ``--castle-naive-max-t`` (2048).
- ``castle-swl-triton``: CASTLE-SWL with ``--castle-window`` (512).
- ``castle-triton-parallel``, ``castle-swl-triton-parallel``: the same through
  ``backend="triton-parallel"``, the key-major schedule (one launch per pass instead of
  the wavefront's ``2 T / 64``; ``ops/castle/README.md``).
- ``lookahead-keys-attention``: the public package of that name (0.1.2, import name
  ``lookahead_keys_attention``; its Triton ``castle_attention_triton(q, k, v, qu, ku, vu,
  scale, return_U_for_cache)`` in ``[B, H, T, D]``, computing in float16, O(T^3) per the
  issue), when importable; it needs ``einops`` and ``rotary-embedding-torch``; no
  grouped-query attention, no varlen. Not a dependency of lapse: carry its wheel.

They are checked against ``castle_attention(..., backend="torch")`` (float32 arithmetic,
the same window), not against Flex. Their TFLOP/s use the same formula as the others
(causal softmax attention's FLOPs): CASTLE does about 3.5x those forward and 3.9x forward
and backward (``ops/castle/README.md``), so read them as "softmax-equivalent".

Ratios. The softmax baselines (``SOFTMAX_BASELINES``: SDPA's and FlashAttention-4) compute
no gate: they are the speed to match. Every provider's time is divided by the fastest of
them that ran in the same workload, per mode (the forward and the forward+backward may pick
different ones), and the table header names it. With ACP, ``efficiency = t_dense * (1 - pruned) / t_acp``
(``flash-attn-4-acp``: against ``flash-attn-4``, with the same ``pruned``).

Method. Each workload (one per ``--seq-lens`` value, or one varlen workload) is drawn by
:mod:`lapse.bench.workloads` on the GPU. First a correctness check: the output (and, when
``fwd+bwd`` is timed, the gradients of q, k, v and the log gates under a fixed random
``dO``) of every gated provider is compared with FlexAttention (the lapse ``torch``
backend if Flex fails); a provider that fails the check is not timed. Then each provider
is timed with ``triton.testing.do_bench(..., return_mode="median")``: ``fwd`` under
``torch.no_grad()``; ``fwd+bwd`` as the forward followed by ``torch.autograd.grad`` of
every differentiable input (the gates included) under ``dO``. FLOPs are those of dense
causal attention (:func:`lapse.bench.workloads.dense_causal_flops`), pruned or not. Peak
memory (on CUDA): ``torch.cuda.max_memory_allocated`` during one more call of each mode,
less what was allocated before it (the call's outputs, gradients and work buffers; an
``L x L`` buffer at T = 16k shows as gigabytes).
Failures are caught and reported as ``n/a: reason``; nothing is skipped silently.

Diagnostics. ``--profile`` runs each timed call a few more times under ``torch.profiler``
and writes profile.md beside results.md: its kernels by GPU time, their sum against the timed
ms, and the host's time to issue the call (:func:`profile_markdown`). ``--sweep fwd bwd``
times the FoX Triton kernels' tile options against their tables after the providers
(:mod:`lapse.bench.sweep`, sweep.md).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import gc
import inspect
import json
import math
import platform
import time
import traceback
import typing
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from lapse.files import write_text_atomic

from .commit import git_commit
from .config import SOFTMAX_BASELINES, AttentionBenchConfig, Provider
from .workloads import Workload, WorkloadSpec, dense_causal_flops, make_workload

PRUNED: dict[Provider, Provider] = {"lapse-acp": "lapse", "flash-attn-4-acp": "flash-attn-4"}
"""Providers that skip ACP's pruned tiles, each with its dense counterpart (their efficiency)."""
CASTLE_PROVIDERS: tuple[Provider, ...] = tuple(
    p for p in typing.get_args(Provider) if p.startswith("castle") or p == "lookahead-keys-attention"
)
GATED: tuple[Provider, ...] = ("lapse", "lapse-acp", "flex", "flex-flash", "fla")
BWD_FLOP_FACTOR = 2.5
FLOP_FORMULA = (
    "fwd FLOPs = sum over sequences of 4 * L^2 * HQ * D / 2 (QK^T and PV, 2*L*L*D each, "
    "halved for causality; pruned tiles counted as dense); bwd = 2.5 x fwd; "
    "fwd+bwd = 3.5 x fwd"
)


class NotAvailable(Exception):
    """A provider cannot run here (missing library, unsupported feature); the message says why."""


@dataclass
class Runner:
    """One provider set up on one workload.

    ``forward()`` runs the op on inputs prepared in the provider's own layout;
    ``grad_inputs`` are the leaves ``fwd+bwd`` differentiates (gates included where the
    provider has them). ``to_bthd`` maps its output, and ``grad_to_bthd`` its gradients,
    to lapse's layout for the check; ``from_bthd`` maps ``dO`` the other way. ``context``
    wraps every call (the SDPA backend choice).
    """

    forward: Callable[[], Tensor]
    grad_inputs: list[Tensor]
    to_bthd: Callable[[Tensor], Tensor] = lambda o: o
    from_bthd: Callable[[Tensor], Tensor] = lambda o: o
    grad_to_bthd: Callable[[list[Tensor]], list[Tensor]] = lambda g: g
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    notes: list[str] = field(default_factory=list)


def _leaf(x: Tensor) -> Tensor:
    return x.detach().clone().requires_grad_(True)


def _lapse_runner(wl: Workload, acp, acp_eps: float) -> Runner:
    from lapse.ops.forgetting import forgetting_attention

    q, k, v, g = (_leaf(t) for t in (wl.q, wl.k, wl.v, wl.log_fgate))

    def forward() -> Tensor:
        return forgetting_attention(
            q, k, v, g, acp=acp, acp_eps=acp_eps, cu_seqlens=wl.cu_seqlens, backend="triton"
        )

    return Runner(forward, [q, k, v, g])


def _ran_kernels(fn: Callable[[], Tensor]) -> str:
    """Which SDPA backend a call ran, read from its kernel names under the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof, torch.no_grad():
        fn()
        torch.cuda.synchronize()
    names = " ".join(e.key.lower() for e in prof.key_averages())
    for key, label in (
        ("cudnn", "cuDNN"),
        ("flash", "FlashAttention-2"),
        ("fmha", "memory-efficient"),
        ("efficient", "memory-efficient"),
    ):
        if key in names:
            return label
    return "math (no fused kernel seen)"


def _sdpa_runner(wl: Workload, name: Provider) -> Runner:
    """SDPA with PyTorch's own choice of backend (``sdpa-default``: what a user gets; on an
    H100 with torch 2.11, cuDNN), named in the notes from the kernels it ran, or forced to
    one backend. A forced backend that cannot take these shapes on this device is
    :class:`NotAvailable`, with the reasons SDPA gave."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {
        "sdpa-default": None,
        "sdpa-flash": SDPBackend.FLASH_ATTENTION,
        "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
        "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
    }[name]
    context = contextlib.nullcontext if backend is None else lambda: sdpa_kernel(backend)
    spec = wl.spec
    gqa = spec.heads != spec.num_kv_heads
    notes: list[str] = ["no forget gate: causal softmax attention only"]
    if spec.varlen:
        if backend not in (None, SDPBackend.FLASH_ATTENTION):
            raise NotAvailable(
                f"varlen_attn has no backend choice (it runs FlashAttention): no {name} for packed sequences"
            )
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError as e:
            raise NotAvailable(f"torch.nn.attention.varlen missing ({e})") from e
        params = inspect.signature(varlen_attn).parameters
        q, k, v = (_leaf(t[0]) for t in (wl.q, wl.k, wl.v))  # [T, H, D]
        kw: dict = {}
        if "window_size" in params:
            kw["window_size"] = (-1, 0)
        elif "is_causal" in params:
            kw["is_causal"] = True
        else:
            raise NotAvailable("varlen_attn has neither window_size nor is_causal")
        if gqa and "enable_gqa" in params:
            kw["enable_gqa"] = True
        elif gqa:
            group = spec.heads // spec.num_kv_heads
            k, v = (_leaf(x.detach().repeat_interleave(group, dim=1)) for x in (k, v))
            notes.append("K/V expanded to the query heads outside the timed region")
        cu = wl.cu_seqlens
        longest = max(spec.seqlens)

        def forward() -> Tensor:
            return varlen_attn(q, k, v, cu, cu, longest, longest, **kw)

        notes.append("varlen via torch.nn.attention.varlen.varlen_attn")
        runner = Runner(forward, [q, k, v], to_bthd=lambda o: o[None], from_bthd=lambda o: o[0], notes=notes)
    else:
        q, k, v = (_leaf(t.transpose(1, 2).contiguous()) for t in (wl.q, wl.k, wl.v))
        F = torch.nn.functional
        if gqa:
            try:  # recent torch takes grouped K/V natively on some backends; probe once
                with context(), torch.no_grad(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            except RuntimeError as e:
                group = spec.heads // spec.num_kv_heads
                k, v = (_leaf(x.detach().repeat_interleave(group, dim=1)) for x in (k, v))
                gqa = False
                notes.append(f"K/V expanded to the query heads outside the timed region ({_short(e)})")

        def forward() -> Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

        runner = Runner(
            forward,
            [q, k, v],
            to_bthd=lambda o: o.transpose(1, 2),
            from_bthd=lambda o: o.transpose(1, 2),
            grad_to_bthd=lambda gs: [g.transpose(1, 2) for g in gs],
            context=context,
            notes=notes,
        )
    try:  # a forced backend raises here, and warns why, when it cannot take these inputs
        with runner.context(), torch.no_grad(), warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            runner.forward()
    except RuntimeError as e:
        why = "; ".join(dict.fromkeys(str(w.message).strip().splitlines()[0] for w in warned))
        raise NotAvailable(f"{name}: SDPA refused ({_short(e)}){f': {why}' if why else ''}"[:500]) from e
    if backend is None and q.is_cuda:
        notes.append(f"SDPA's default backend choice: {_ran_kernels(forward)} ran")
    return runner


def _fa4_runner(wl: Workload) -> Runner:
    """FlashAttention-4 (``flash_attn.cute``), causal softmax attention without a gate, in
    lapse's layout (``[B, T, H, D]``; packed sequences ``[T, H, D]`` with ``cu_seqlens``).
    Its first call, which compiles the kernels, runs here, outside the timed region; a
    failure there is :class:`NotAvailable` with FlashAttention's reason."""
    if not _on_gpu(wl.q):
        raise NotAvailable("flash-attn-4 runs on CUDA GPUs only")
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except Exception as e:  # ImportError, or the CuTe DSL compiler missing or broken
        raise NotAvailable(f"flash-attn-4 not importable ({_short(e)})") from e
    spec = wl.spec
    notes = ["no forget gate: causal softmax attention only"]
    if spec.varlen:
        q, k, v = (_leaf(t[0]) for t in (wl.q, wl.k, wl.v))  # [T, H, D]
        cu, longest = wl.cu_seqlens, max(spec.seqlens)

        def forward() -> Tensor:
            return _output(flash_attn_varlen_func(
                q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
                softmax_scale=spec.scale, causal=True))

        runner = Runner(forward, [q, k, v], to_bthd=lambda o: o[None], from_bthd=lambda o: o[0], notes=notes)
    else:
        q, k, v = (_leaf(t) for t in (wl.q, wl.k, wl.v))

        def forward() -> Tensor:
            return _output(flash_attn_func(q, k, v, softmax_scale=spec.scale, causal=True))

        runner = Runner(forward, [q, k, v], notes=notes)
    return _first_call(runner, "flash-attn-4")  # its version: in the results' header (environment())


def _fa4_acp_runner(wl: Workload, cfg: AttentionBenchConfig) -> Runner:
    """FlashAttention-4 with its block sparsity on the tiles ``lapse-acp`` visits, no gate (the
    module's docstring). The boundaries and the tile lists are made here, before the timing, as
    lapse's FlashAttention-4 backward makes its own (``fa4_prep``)."""
    spec = wl.spec
    if not _on_gpu(wl.q):
        raise NotAvailable("flash-attn-4 runs on CUDA GPUs only")
    if spec.varlen:
        raise NotAvailable("FlashAttention-4's backward takes no block sparsity with packed sequences")
    if not _on_hopper(wl.q):
        raise NotAvailable("the tile lists follow FlashAttention-4's Hopper (sm90) tiles")
    try:
        from flash_attn.cute import flash_attn_func, interface
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    except Exception as e:  # ImportError, or the CuTe DSL compiler missing or broken
        raise NotAvailable(f"flash-attn-4 not importable ({_short(e)})") from e
    from lapse.ops.forgetting import ACP_BLOCK, common, fa4_fwd, fa4_prep
    from lapse.ops.forgetting.pruning import triton_acp_block_start
    from lapse.ops.forgetting.triton_ops import triton_gate_cumsum

    p = common.validate(wl.q, wl.k, wl.v, wl.log_fgate, None, None, "triton")
    with torch.no_grad():
        cum = triton_gate_cumsum(wl.log_fgate, p)
        starts = triton_acp_block_start(_acp_argument(cfg, spec), cfg.acp_eps, wl.q, wl.k, *cum, p)
    starts, t = starts.to(torch.int32).contiguous(), spec.seq_len
    tm, tn = fa4_fwd.tiles(spec.head_dim)
    count, index = fa4_prep.acp_key_tiles(starts, t, tm, tn, ACP_BLOCK)
    full = count.new_zeros(count.shape), count.new_zeros(*count.shape, 1)  # none: every tile "masked"
    fwd = BlockSparseTensorsTorch(count, index, *full, block_size=(tm, tn))
    tiles = interface._tile_size_bwd_sm90(spec.head_dim, spec.head_dim, True, False)
    bm, bn = tiles.m_block_size, tiles.n_block_size
    bwd = BlockSparseTensorsTorch(*fa4_prep.acp_blocks(starts, t, bm, bn, ACP_BLOCK), block_size=(bm, bn))
    q, k, v = (_leaf(x) for x in (wl.q, wl.k, wl.v))

    def forward() -> Tensor:
        return _output(flash_attn_func(q, k, v, softmax_scale=spec.scale, causal=True,
                                       block_sparse_tensors=fwd, block_sparse_tensors_bwd=bwd))

    notes = [f"no forget gate: FlashAttention-4's block sparsity on lapse-acp's tiles ({tm} x {tn} forward, "
             f"{bm} x {bn} backward), lists made outside the timed call"]
    return _first_call(Runner(forward, [q, k, v], notes=notes), "flash-attn-4")


def _first_call(runner: Runner, name: str) -> Runner:
    """``runner`` after its first forward (a compile, outside the timed region); a failure
    there is :class:`NotAvailable` with the kernel's reason."""
    try:
        with torch.no_grad():
            runner.forward()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except Exception as e:
        raise NotAvailable(f"{name} failed on these inputs ({_short(e)})") from e
    return runner


def _on_gpu(x: Tensor) -> bool:
    return x.is_cuda


def _on_hopper(x: Tensor) -> bool:
    return torch.cuda.get_device_capability(x.device)[0] == 9


def _output(out) -> Tensor:
    """FlashAttention-4 returns ``(out, lse)``; older releases the output alone."""
    return out[0] if isinstance(out, tuple) else out


def _flex_fox(q, k, v, log_fgate, block_mask, enable_gqa):
    """Forgetting attention as FlexAttention: a decay score_mod over the cumulative gate."""
    from torch.nn.attention.flex_attention import flex_attention

    c_q = log_fgate.float().cumsum(dim=1).transpose(1, 2).contiguous()  # [B, HQ, T]
    # Flex's backward cannot differentiate one tensor indexed twice in a score_mod, so the
    # key side reads a copy (autograd sums both paths back into the gates).
    c_k = c_q.clone()

    def decay(score, b, h, q_idx, kv_idx):
        return score + c_q[b, h, q_idx] - c_k[b, h, kv_idx]

    return flex_attention(q, k, v, score_mod=decay, block_mask=block_mask, enable_gqa=enable_gqa)


def _flex_decay(q, k, v, c_q, c_k, block_mask, enable_gqa, kernel_options):
    """:func:`_flex_fox` with the cumulative gate given (``c_q``, and ``c_k`` a copy)."""
    from torch.nn.attention.flex_attention import flex_attention

    def decay(score, b, h, q_idx, kv_idx):
        return score + c_q[b, h, q_idx] - c_k[b, h, kv_idx]

    return flex_attention(q, k, v, score_mod=decay, block_mask=block_mask, enable_gqa=enable_gqa,
                          kernel_options=kernel_options)


def _flex_runner(wl: Workload, flash: bool = False) -> Runner:
    """FlexAttention with the decay score_mod; ``flash``: through its ``BACKEND="FLASH"``
    kernels (FlashAttention-4's CuTe DSL, ``flash-attn-4`` installed), whose first call,
    the compile, runs here: a failure there is :class:`NotAvailable` with torch's reason."""
    if flash and not _on_gpu(wl.q):
        raise NotAvailable("flex-flash runs on CUDA GPUs only")
    try:
        from torch.nn.attention.flex_attention import create_block_mask
    except ImportError as e:
        raise NotAvailable(f"FlexAttention missing ({e})") from e
    spec = wl.spec
    t = spec.time
    if spec.varlen:
        doc = torch.repeat_interleave(
            torch.arange(len(spec.seqlens), device=wl.q.device),
            torch.tensor(spec.seqlens, device=wl.q.device),
        )  # [T] sequence id of each packed token

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (doc[q_idx] == doc[kv_idx])
    else:

        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx

    block_mask = create_block_mask(mask_mod, None, None, t, t, device=wl.q.device)
    q, k, v = (_leaf(x.transpose(1, 2).contiguous()) for x in (wl.q, wl.k, wl.v))
    g = _leaf(wl.log_fgate)
    gqa = spec.heads != spec.num_kv_heads
    # the FLASH backend reads only graph inputs in a score_mod (torch 2.11): c is made outside
    compiled = torch.compile(_flex_decay if flash else _flex_fox, dynamic=False)
    if flash:

        def forward() -> Tensor:
            c = g.float().cumsum(dim=1).transpose(1, 2).contiguous()  # [B, HQ, T]
            return compiled(q, k, v, c, c.clone(), block_mask, gqa, {"BACKEND": "FLASH"})
    else:

        def forward() -> Tensor:
            return compiled(q, k, v, g, block_mask, gqa)

    runner = Runner(
        forward,
        [q, k, v, g],
        to_bthd=lambda o: o.transpose(1, 2),
        from_bthd=lambda o: o.transpose(1, 2),
        grad_to_bthd=lambda gs: [x.transpose(1, 2) for x in gs[:3]] + gs[3:],
        notes=["score_mod: score + c[b,h,q] - c[b,h,kv], c = float32 cumsum of log gates"],
    )
    if flash:
        runner.notes.append("kernel_options BACKEND='FLASH' (FlashAttention-4's CuTe DSL kernels)")
        try:
            with torch.no_grad():
                forward()
            torch.cuda.synchronize()
        except Exception as e:
            raise NotAvailable(f"flex-flash failed on these inputs ({_short(e)})") from e
    return runner


def _fla_runner(wl: Workload) -> Runner:
    try:
        import fla
        from fla.ops.forgetting_attn import parallel_forgetting_attn
    except Exception as e:  # ImportError, or a broken install of fla's dependencies
        raise NotAvailable(f"fla not importable ({type(e).__name__}: {e})") from e
    q, k, v, g = (_leaf(t) for t in (wl.q, wl.k, wl.v, wl.log_fgate))
    cu = None if wl.cu_seqlens is None else wl.cu_seqlens.long()

    def forward() -> Tensor:
        return parallel_forgetting_attn(q, k, v, g, scale=wl.spec.scale, cu_seqlens=cu)

    return Runner(forward, [q, k, v, g], notes=[f"fla {fla.__version__}"])


def castle_lookahead(wl: Workload, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """CASTLE's lookahead ``Q^U [B, T, HQ, D]``, ``K^U, V^U [B, T, H, D]`` for workload
    ``wl`` (whose ``q, k, v`` are the causal ones), drawn like them from ``seed + 2``."""
    from .workloads import rms_normalise

    b, t, hq, d = wl.q.shape
    h = wl.k.shape[2]
    gen = torch.Generator(device=wl.q.device)
    gen.manual_seed(seed + 2)

    def normal(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, device=wl.q.device, dtype=torch.float32)

    q_u = rms_normalise(normal(b, t, hq, d)).to(wl.q.dtype)
    k_u = rms_normalise(normal(b, t, h, d)).to(wl.q.dtype)
    return q_u, k_u, normal(b, t, h, d).to(wl.q.dtype)


def castle_window_of(name: str, cfg: AttentionBenchConfig) -> int | None:
    """The lookahead window a CASTLE provider computes with (``None``: CASTLE)."""
    return cfg.castle_window if name.startswith("castle-swl-") else None


def _castle_runner(wl: Workload, backend: str, window: int | None, cfg: AttentionBenchConfig) -> Runner:
    from lapse.ops.castle import castle_attention

    longest = max(wl.spec.seqlens)
    if backend == "naive" and longest > cfg.castle_naive_max_t:
        raise NotAvailable(
            f"castle-naive is O(T^3) with T x T buffers: skipped at T = {longest} > "
            f"--castle-naive-max-t {cfg.castle_naive_max_t}"
        )
    six = [_leaf(x) for x in (wl.q, wl.k, wl.v, *castle_lookahead(wl, cfg.seed))]

    def forward() -> Tensor:
        return castle_attention(
            *six, scale=wl.spec.scale, window=window, cu_seqlens=wl.cu_seqlens, backend=backend
        )

    notes = [f"CASTLE{'' if window is None else f'-SWL, window {window}'}, backend {backend}"]
    if wl.cu_seqlens is not None:
        notes.append("varlen: one call per sequence (castle_attention reads cu_seqlens on the host)")
    return Runner(forward, six, notes=notes)


def _lookahead_keys_attention_runner(wl: Workload, cfg: AttentionBenchConfig) -> Runner:
    """The public ``lookahead-keys-attention`` 0.1.2 (Triton), in its ``[B, H, T, D]`` layout."""
    try:
        from importlib.metadata import version

        from lookahead_keys_attention.lookahead_keys_attention_triton import castle_attention_triton
    except Exception as e:  # not installed, or its dependencies (einops, rotary-embedding-torch) missing
        raise NotAvailable(f"lookahead_keys_attention not importable ({type(e).__name__}: {e})") from e
    spec = wl.spec
    if spec.varlen:
        raise NotAvailable("lookahead-keys-attention takes no packed sequences (cu_seqlens)")
    if spec.heads != spec.num_kv_heads:
        raise NotAvailable("lookahead-keys-attention takes no grouped-query attention (HQ must equal H)")
    six = [_leaf(x.transpose(1, 2).contiguous()) for x in (wl.q, wl.k, wl.v, *castle_lookahead(wl, cfg.seed))]

    def forward() -> Tensor:
        return castle_attention_triton(*six, spec.scale, False)

    return Runner(
        forward,
        six,
        to_bthd=lambda o: o.transpose(1, 2),
        from_bthd=lambda o: o.transpose(1, 2),
        grad_to_bthd=lambda gs: [g.transpose(1, 2) for g in gs],
        notes=[f"lookahead-keys-attention {version('lookahead-keys-attention')} (float16 inside)"],
    )


def _castle_reference(
    wl: Workload, window: int | None, d_out: Tensor, want_grads: bool, cfg: AttentionBenchConfig
) -> dict:
    """CASTLE's output (and six gradients) from ``castle_attention(backend="torch")``."""
    ref: dict = {"out": None, "grads": None, "out_from": None, "grads_from": None, "notes": []}
    try:
        r = _castle_runner(wl, "torch", window, cfg)
        if want_grads:
            o = r.forward()
            ref["grads"] = [g.detach() for g in torch.autograd.grad(o, r.grad_inputs, d_out)]
            ref["grads_from"] = "castle-torch"
        else:
            with torch.no_grad():
                o = r.forward()
        ref["out"], ref["out_from"] = o.detach(), "castle-torch"
    except Exception as e:
        ref["notes"].append(f"castle torch backend failed: {_short(e)}")
    return ref


def _acp_argument(cfg: AttentionBenchConfig, spec: WorkloadSpec):
    return "auto" if cfg.acp_bound == "auto" else spec.qk_norm_bound


def build_runner(name: Provider, wl: Workload, cfg: AttentionBenchConfig) -> Runner:
    if name == "lapse":
        return _lapse_runner(wl, None, cfg.acp_eps)
    if name == "lapse-acp":
        return _lapse_runner(wl, _acp_argument(cfg, wl.spec), cfg.acp_eps)
    if name == "flash-attn-4":
        return _fa4_runner(wl)
    if name == "flash-attn-4-acp":
        return _fa4_acp_runner(wl, cfg)
    if name in SOFTMAX_BASELINES:
        return _sdpa_runner(wl, name)
    if name in ("flex", "flex-flash"):
        return _flex_runner(wl, flash=name == "flex-flash")
    if name == "fla":
        return _fla_runner(wl)
    if name in ("castle-triton", "castle-torch", "castle-naive", "castle-swl-triton",
                "castle-triton-parallel", "castle-swl-triton-parallel"):
        backend = name.removeprefix("castle-").removeprefix("swl-")
        return _castle_runner(wl, backend, castle_window_of(name, cfg), cfg)
    if name == "lookahead-keys-attention":
        return _lookahead_keys_attention_runner(wl, cfg)
    raise ValueError(f"unknown provider {name!r}")


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}"[:300]


def _rel_err(a: Tensor, b: Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _fwd_bwd(r: Runner, d_out: Tensor) -> list[Tensor]:
    """Gradients of every differentiable input under ``dO`` (given as ``[B, T, HQ, D]``)."""
    return list(torch.autograd.grad(r.forward(), r.grad_inputs, r.from_bthd(d_out)))


def _reference(wl: Workload, d_out: Tensor, want_grads: bool) -> dict:
    """Output (and gradients) of the same function from FlexAttention, else from lapse's
    torch backend; records which one gave what, and why."""
    ref: dict = {"out": None, "grads": None, "out_from": None, "grads_from": None, "notes": []}
    try:
        r = _flex_runner(wl)
        with r.context():
            with torch.no_grad():
                ref["out"] = r.to_bthd(r.forward()).detach().clone()
            ref["out_from"] = "flex"
            if want_grads:
                try:
                    ref["grads"] = [g.detach().clone() for g in r.grad_to_bthd(_fwd_bwd(r, d_out))]
                    ref["grads_from"] = "flex"
                except Exception as e:
                    ref["notes"].append(f"flex backward failed: {_short(e)}")
    except Exception as e:
        ref["notes"].append(f"flex forward failed: {_short(e)}")
    if ref["out"] is None or (want_grads and ref["grads"] is None):
        try:
            from lapse.ops.forgetting import forgetting_attention

            q, k, v, g = (_leaf(t) for t in (wl.q, wl.k, wl.v, wl.log_fgate))
            o = forgetting_attention(q, k, v, g, cu_seqlens=wl.cu_seqlens, backend="torch")
            if ref["out"] is None:
                ref["out"], ref["out_from"] = o.detach().clone(), "lapse-torch"
            if want_grads and ref["grads"] is None:
                ref["grads"] = [x.detach() for x in torch.autograd.grad(o, [q, k, v, g], d_out)]
                ref["grads_from"] = "lapse-torch"
        except Exception as e:
            ref["notes"].append(f"lapse torch backend failed: {_short(e)}")
    return ref


def _check(r: Runner, ref: dict, d_out: Tensor, want_grads: bool, cfg) -> dict:
    """Relative errors of one provider against the reference; ``status`` is ``ok``,
    ``FAILED`` (an error above tolerance) or ``unchecked`` (no reference)."""
    if ref["out"] is None:
        return {"status": "unchecked", "reason": "; ".join(ref["notes"]) or "no reference"}
    out: dict = {"reference": ref["out_from"]}
    with r.context():
        with torch.no_grad():
            out["out_rel_err"] = _rel_err(r.to_bthd(r.forward()), ref["out"])
        if want_grads and ref["grads"] is not None:
            out["grads_reference"] = ref["grads_from"]
            try:
                grads = r.grad_to_bthd(_fwd_bwd(r, d_out))
            except Exception as e:  # the fwd+bwd timing reports it too
                out["grad_error"] = _short(e)
            else:
                names = (
                    ["dq", "dk", "dv", "dlog_fgate"]
                    if len(grads) <= 4
                    else ["dq_c", "dk_c", "dv_c", "dq_u", "dk_u", "dv_u"]
                )[: len(grads)]
                out["grad_rel_err"] = {
                    n: _rel_err(a, b) for n, a, b in zip(names, grads, ref["grads"], strict=True)
                }
    bad = out["out_rel_err"] > cfg.check_tol or any(
        e > cfg.grad_check_tol for e in out.get("grad_rel_err", {}).values()
    )
    out["status"] = "FAILED" if bad else "ok"
    return out


def _time(fn: Callable[[], object], cfg: AttentionBenchConfig) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=cfg.warmup_ms, rep=cfg.rep_ms, return_mode="median"))


def _causal_tile_area(length: int, block: int) -> int:
    """Causal tile area of one sequence (as :func:`pruned_fraction` counts it)."""
    area = 0
    for m in range(-(-length // block)):
        rows = min(block, length - m * block)
        area += rows * min((m + 1) * block, length)
    return area


def _pruned_fraction(wl: Workload, acp, eps: float) -> float:
    """Share of the causal tiles that ACP skipped, weighted by each sequence's tile area."""
    from lapse.ops.forgetting import ACP_BLOCK, forgetting_attention

    with torch.no_grad():
        _, stats = forgetting_attention(
            wl.q,
            wl.k,
            wl.v,
            wl.log_fgate,
            acp=acp,
            acp_eps=eps,
            cu_seqlens=wl.cu_seqlens,
            return_stats=True,
            backend="triton",
        )
    pf = stats.pruned_fraction.double().mean(dim=1).cpu()  # [B]
    area = torch.tensor([_causal_tile_area(n, ACP_BLOCK) for n in wl.spec.seqlens]).double()
    return float((pf * area).sum() / area.sum())


def _time_graphed(fn: Callable[[], object], cfg: AttentionBenchConfig) -> float:
    """The GPU time of ``fn``'s kernels: ``fn`` captured once in a CUDA graph and the replay
    timed. Timed eagerly, a call whose kernels take less time than their launches measures
    the host's launches instead (``do_bench`` records its events around them)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the warm-up (and compile) on a side stream, as capture asks
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _time(graph.replay, cfg)


def _time_boundary_search(wl: Workload, acp, cfg: AttentionBenchConfig) -> dict:
    """ACP's extra work, timed alone: the boundary search (``triton_block_start``) and the
    bound ``delta`` (``acp_delta``: with ``acp="auto"`` the query/key norms and delta in two
    launches). The op itself folds delta into the search (``triton_acp_block_start``): these
    two times add up to a little more than it spends. Each is called eagerly (``search_ms``,
    ``bound_ms``: with the host's launches, which short kernels wait on) and replayed from a
    CUDA graph (``*_graph_ms``: its kernels' GPU time, what the ACP forward pays when the host
    runs ahead; ``*_graph_error`` where the capture fails)."""
    from lapse.ops.forgetting import common
    from lapse.ops.forgetting.pruning import triton_acp_bound, triton_acp_delta, triton_block_start
    from lapse.ops.forgetting.triton_ops import triton_gate_cumsum

    q, k, v, g = wl.q, wl.k, wl.v, wl.log_fgate
    p = common.validate(q, k, v, g, None, wl.cu_seqlens, "triton")
    cum = triton_gate_cumsum(g, p)

    def bound() -> Tensor:
        return common.acp_delta(acp, cfg.acp_eps, q, k, p, triton_acp_bound, triton_acp_delta)

    delta = bound()

    def search() -> Tensor:
        return triton_block_start(*cum, delta, p)

    with torch.no_grad():
        out = {"search_ms": _time(search, cfg), "bound_ms": _time(bound, cfg)}
        for key, fn in (("search", search), ("bound", bound)):
            try:
                out[f"{key}_graph_ms"] = _time_graphed(fn, cfg)
            except Exception as e:  # a host read inside (packed lengths): the eager time stands
                out[f"{key}_graph_error"] = _short(e)
        return out


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _peak_mib(fn: Callable[[], object]) -> float | None:
    """Peak CUDA memory of one call of ``fn`` above what was allocated before it, in MiB
    (``None`` without CUDA)."""
    if not torch.cuda.is_available():
        return None
    _free()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


PROFILED_CALLS = 5
"""Calls of each timed call run under the profiler (``--profile``), after one untimed."""
PROFILE_ROWS = 15
"""Kernels profile.md lists per call, longest first (results.json has them all)."""


def _host_ms(fn: Callable[[], object], calls: int = 20) -> float:
    """Wall ms the host takes to issue one call of ``fn`` while the GPU is busy: a queue of
    matmuls (tens of ms) goes first, so no call waits for the GPU unless it reads a value back
    (then its GPU time shows here too)."""
    busy = torch.randn(8192, 8192, device="cuda")
    fn()
    torch.cuda.synchronize()
    for _ in range(3):
        busy @ busy
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    ms = (time.perf_counter() - t0) / calls * 1e3
    torch.cuda.synchronize()
    return ms


def _profile(fn: Callable[[], object]) -> dict:
    """What one call of ``fn`` spends, from ``torch.profiler`` over :data:`PROFILED_CALLS` calls
    after an untimed one: ``kernels``, name to ms per call, longest first (on CUDA each kernel's
    GPU time; on a CPU each operator's own CPU time, its children's left out), ``kernel_ms``
    their sum and, on CUDA, ``host_ms`` (:func:`_host_ms`). A timed ms above ``kernel_ms`` is
    time the GPU waited; one near ``host_ms``, a call bound by the host's launches."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(PROFILED_CALLS):
            fn()
        sync()
    times: dict[str, float] = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == (DeviceType.CUDA if cuda else DeviceType.CPU):
            times[ev.name] += (ev.device_time if cuda else ev.self_cpu_time_total) / 1e3 / PROFILED_CALLS
    kernels = dict(sorted(((n, t) for n, t in times.items() if t > 0), key=lambda kv: -kv[1]))
    out = {"calls": PROFILED_CALLS, "kernels": kernels, "kernel_ms": sum(kernels.values())}
    if cuda:
        out["host_ms"] = _host_ms(fn)
    return out


def profile_markdown(result: dict, modes) -> str:
    """``--profile``'s page for one workload: per provider and mode, the timed ms against the
    kernels' sum and the host's time, then the longest kernels."""
    out = []
    for name, row in result["providers"].items():
        for mode in modes:
            prof = row.get(mode, {}).get("profile")
            if prof is None:
                continue
            ms, kernel_ms = row[mode]["ms"], prof["kernel_ms"]
            host = f"; host {prof['host_ms']:.3f} ms to issue it" if "host_ms" in prof else ""
            out += [f"### {name}, {mode}: timed {ms:.3f} ms; kernels {kernel_ms:.3f} ms a call "
                    f"({kernel_ms / ms:.0%} of it){host}", "",
                    "| ms a call | share of the kernels | kernel |", "| --- | --- | --- |"]
            kernels = list(prof["kernels"].items())
            for kernel, t in kernels[:PROFILE_ROWS]:
                out.append(f"| {t:.4f} | {t / kernel_ms:.1%} | `{kernel[:100]}` |")
            if len(kernels) > PROFILE_ROWS:
                rest = sum(t for _, t in kernels[PROFILE_ROWS:])
                out.append(f"| {rest:.4f} | {rest / kernel_ms:.1%} | {len(kernels) - PROFILE_ROWS} more |")
            out.append("")
    return "\n".join(out)


GRAPH_TIMED = ("lapse", "lapse-acp", *SOFTMAX_BASELINES, "flash-attn-4-acp")


def _graph_ms(r: Runner, mode: str, d_out: Tensor, cfg: AttentionBenchConfig) -> dict:
    """``{"graph_ms": ...}``: the call of ``mode`` captured in a CUDA graph and the replay
    timed, or ``{"graph_error": ...}`` where capture fails. While captured, lapse's kept dS
    gets the eager budget (``triton_bwd.DS_MAX_FRACTION``, not ``DS_MAX_CAPTURED``), so both
    timings run the same kernels where memory is free: the graph is freed right after."""
    from lapse.ops.forgetting import triton_bwd

    captured = triton_bwd.DS_MAX_CAPTURED
    _free()  # the eager timing's cached blocks back before the graph's pool takes its own
    try:
        triton_bwd.DS_MAX_CAPTURED = triton_bwd.DS_MAX_FRACTION
        with r.context():
            if mode == "fwd":
                with torch.no_grad():
                    return {"graph_ms": _time_graphed(r.forward, cfg)}
            d = r.from_bthd(d_out).contiguous()

            def call() -> object:
                return torch.autograd.grad(r.forward(), r.grad_inputs, d)

            return {"graph_ms": _time_graphed(call, cfg)}
    except Exception as e:
        return {"graph_error": _short(e)}
    finally:
        triton_bwd.DS_MAX_CAPTURED = captured
        _free()


def _graph_note(row: dict, modes) -> str:
    """The row's CUDA-graph times: ms, x the fastest softmax's graph time, ACP's efficiency."""
    parts = []
    for mode in modes:
        m = row.get(mode, {})
        if "graph_ms" in m:
            part = f"{mode} {m['graph_ms']:.3f} ms"
            if "graph_vs_fastest" in m:
                part += f" ({m['graph_vs_fastest']:.2f}x)"
            if "graph_efficiency" in m:
                part += f", efficiency {m['graph_efficiency']:.2f}"
            parts.append(part)
        elif "graph_error" in m:
            parts.append(f"{mode} n/a: {m['graph_error']}")
    return "; ".join(parts)


def _bench_provider(
    name: Provider, wl: Workload, cfg: AttentionBenchConfig, ref, d_out: Tensor, result: dict
) -> dict:
    """Sets one provider up, checks it, times it: its row of the result."""
    row: dict = {"notes": []}
    try:
        r = build_runner(name, wl, cfg)
        row["notes"] += r.notes
    except Exception as e:
        row["error"] = _short(e)
        if not isinstance(e, NotAvailable):
            row["traceback"] = traceback.format_exc()
        return row

    if name not in GATED and name not in CASTLE_PROVIDERS:
        row["check"] = {"status": "not comparable", "reason": "computes attention without gate"}
    elif not cfg.check:
        row["check"] = {"status": "unchecked", "reason": "--no-check"}
    elif (name == "flex" and ref["out_from"] == "flex") or name == "castle-torch":
        row["check"] = {"status": "reference"}
    else:
        try:
            row["check"] = _check(r, ref, d_out, "fwd+bwd" in cfg.modes, cfg)
        except Exception as e:
            row["check"] = {"status": "error", "reason": _short(e)}
    status = row["check"]["status"]
    if status in ("FAILED", "error"):
        why = row["check"].get("reason") or _check_cell(row)
        row["error"] = f"check {status} ({why}): not timed"
        return row

    for mode in cfg.modes:
        try:
            profiled = None
            with r.context():
                if mode == "fwd":
                    with torch.no_grad():
                        ms = _time(r.forward, cfg)
                        peak = _peak_mib(r.forward)
                        if cfg.profile:
                            profiled = _profile(r.forward)
                else:
                    d = r.from_bthd(d_out).contiguous()

                    def call(d=d):
                        return torch.autograd.grad(r.forward(), r.grad_inputs, d)

                    ms = _time(call, cfg)
                    peak = _peak_mib(call)
                    if cfg.profile:
                        profiled = _profile(call)
            row[mode] = {"ms": ms, "tflops": result_flops(result, mode) / ms / 1e9, "peak_mib": peak}
            if profiled is not None:
                row[mode]["profile"] = profiled
            if cfg.graph_times and name in GRAPH_TIMED and torch.cuda.is_available():
                if name.startswith("lapse") and wl.cu_seqlens is not None:  # validate reads the lengths
                    row[mode]["graph_error"] = "not captured: packed sequences' lengths are read on the host"
                else:
                    row[mode].update(_graph_ms(r, mode, d_out, cfg))
        except Exception as e:
            row[mode] = {"error": _short(e)}
            row.setdefault("traceback", traceback.format_exc())
        _free()

    if name in PRUNED:
        acp = _acp_argument(cfg, wl.spec)
        row["acp"] = {"bound": acp, "eps": cfg.acp_eps}
        # the same boundaries for every pruned provider: one forward counts them
        known = [r["pruned"] for n, r in result["providers"].items() if n in PRUNED and "pruned" in r]
        try:
            row["pruned"] = known[0] if known else _pruned_fraction(wl, acp, cfg.acp_eps)
        except Exception as e:
            row["notes"].append(f"pruned fraction n/a: {_short(e)}")
    if name == "lapse-acp":
        try:
            row["boundary_search"] = _time_boundary_search(wl, acp, cfg)
        except Exception as e:
            row["boundary_search"] = {"error": _short(e)}
    return row


def bench_workload(spec: WorkloadSpec, cfg: AttentionBenchConfig, progress, device: str = "cuda") -> dict:
    """All providers on one workload; returns the JSON-ready result."""
    wl = make_workload(spec, device=device, seed=cfg.seed)
    gen = torch.Generator(device=device)
    gen.manual_seed(cfg.seed + 1)
    d_out = torch.randn(wl.q.shape, generator=gen, device=device).to(wl.q.dtype)  # [B,T,HQ,D]
    flops = dense_causal_flops(spec)
    want_grads = "fwd+bwd" in cfg.modes
    result: dict = {
        "workload": spec.label,
        "spec": {
            "batch": spec.batch,
            "seq_len": None if spec.varlen else spec.seq_len,
            "seqlens": spec.seqlens,
            "tokens": spec.tokens,
            "heads": spec.heads,
            "kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            "varlen": spec.varlen,
            "dtype": str(spec.dtype),
            "qk_norm_bound": spec.qk_norm_bound,
        },
        "flops_fwd": flops,
        "flops_fwd_bwd": flops * (1 + BWD_FLOP_FACTOR),
        "providers": {},
    }
    ref = None
    if cfg.check and any(p in GATED for p in cfg.providers):
        progress.set_postfix_str(f"{spec.label} reference")
        ref = _reference(wl, d_out, want_grads)
        result["reference"] = {k: ref[k] for k in ("out_from", "grads_from", "notes")}
        _free()
    refs: dict = {"gated": ref}  # and one CASTLE reference per window its providers use
    checked = [p for p in cfg.providers if p in CASTLE_PROVIDERS and p != "castle-torch"]
    if cfg.check and checked:
        for window in dict.fromkeys(castle_window_of(p, cfg) for p in checked):
            progress.set_postfix_str(f"{spec.label} CASTLE reference (window {window})")
            refs[("castle", window)] = castle_ref = _castle_reference(wl, window, d_out, want_grads, cfg)
            result[f"castle_reference_window_{window}"] = {
                k: castle_ref[k] for k in ("out_from", "grads_from", "notes")
            }
            _free()

    for name in cfg.providers:
        progress.set_postfix_str(f"{spec.label} {name}")
        key = ("castle", castle_window_of(name, cfg)) if name in CASTLE_PROVIDERS else "gated"
        result["providers"][name] = _bench_provider(name, wl, cfg, refs.get(key), d_out, result)
        _free()
        progress.update(1)

    if cfg.sweep:
        from .sweep import sweep

        progress.set_postfix_str(f"{spec.label} sweep {' '.join(cfg.sweep)}")
        acps = [None] if "lapse" in cfg.providers else []
        acps += [_acp_argument(cfg, spec)] if "lapse-acp" in cfg.providers else []
        try:
            result["sweep"] = sweep(wl, d_out, cfg.sweep, acps, cfg.acp_eps, lambda fn: _time(fn, cfg))
        except Exception as e:
            result["sweep_error"] = _short(e)
        _free()
    _derive(result)
    return result


def result_flops(result: dict, mode: str) -> float:
    return result["flops_fwd"] if mode == "fwd" else result["flops_fwd_bwd"]


def _derive(result: dict) -> None:
    """From the timings: the fastest softmax baseline of each mode
    (``result["fastest_softmax"][mode] = {"provider", "ms"}``), every provider's ratio to it
    (``vs_fastest``) and to SDPA FlashAttention-2 (``vs_sdpa_flash``, comparable with the
    older tables, whose baseline it was), the same for the CUDA-graph times against the fastest
    baseline's graph time (``fastest_softmax_graph``, ``graph_vs_fastest``), ACP efficiency
    and the boundary-search share."""
    rows = result["providers"]

    def ms(name: str | None, mode: str, key: str = "ms") -> float | None:
        return rows.get(name, {}).get(mode, {}).get(key)

    result["fastest_softmax"] = {}
    for mode in ("fwd", "fwd+bwd"):
        ran = [(ms(name, mode), name) for name in SOFTMAX_BASELINES if ms(name, mode) is not None]
        if ran:
            t_fast, fastest = min(ran)
            result["fastest_softmax"][mode] = {"provider": fastest, "ms": t_fast}
        t_flash = ms("sdpa-flash", mode)
        for row in rows.values():
            t = row.get(mode, {}).get("ms")
            if t is not None and ran:
                row[mode]["vs_fastest"] = t / t_fast
            if t is not None and t_flash is not None:
                row[mode]["vs_sdpa_flash"] = t / t_flash
        # graph times against the fastest baseline's graph time (eager and graph can rank two
        # close baselines differently: FlashAttention-4 and cuDNN are within a few per cent)
        graphed = [(ms(name, mode, "graph_ms"), name) for name in SOFTMAX_BASELINES
                   if ms(name, mode, "graph_ms") is not None]
        if graphed:
            t_graph, fastest_graph = min(graphed)
            result.setdefault("fastest_softmax_graph", {})[mode] = {"provider": fastest_graph, "ms": t_graph}
            for row in rows.values():
                g = row.get(mode, {}).get("graph_ms")
                if g is not None:
                    row[mode]["graph_vs_fastest"] = g / t_graph
    for name, dense in PRUNED.items():
        pruned = rows.get(name, {}).get("pruned")
        for mode in ("fwd", "fwd+bwd"):
            for key, out in (("ms", "efficiency"), ("graph_ms", "graph_efficiency")):
                t_dense, t_acp = ms(dense, mode, key), ms(name, mode, key)
                if None not in (pruned, t_dense, t_acp):
                    rows[name][mode][out] = t_dense * (1 - pruned) / t_acp
    acp = rows.get("lapse-acp")
    if acp is None:
        return
    search = acp.get("boundary_search", {})
    t_acp = ms("lapse-acp", "fwd")
    if "search_ms" in search and t_acp is not None:
        search["search_pct_of_acp_fwd"] = 100 * search["search_ms"] / t_acp
        search["bound_pct_of_acp_fwd"] = 100 * search["bound_ms"] / t_acp


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _cell(row: dict, mode: str, key: str, spec: str) -> str:
    m = row.get(mode)
    if m is None:
        return "-"
    if "error" in m:
        return "n/a"
    return _fmt(m.get(key), spec)


def _check_cell(row: dict) -> str:
    c = row.get("check", {})
    status = c.get("status", "-")
    if "out_rel_err" in c:
        worst_grad = max(c.get("grad_rel_err", {}).values(), default=None)
        s = f"{status}: o {c['out_rel_err']:.1e}"
        if worst_grad is not None:
            s += f", grads <= {worst_grad:.1e}"
        elif "grad_error" in c:
            s += ", grads n/a"
        return s
    return status


def fastest_header(result: dict, mode: str) -> str:
    """The ratio column's header, naming the baseline: ``fwd x fastest softmax (sdpa-cudnn)``."""
    fastest = result.get("fastest_softmax", {}).get(mode)
    return f"{mode} x fastest softmax ({fastest['provider'] if fastest else 'none ran'})"


def markdown_table(result: dict, modes: tuple[str, ...]) -> str:
    head = ["provider"]
    for mode in modes:
        head += [f"{mode} ms", f"{mode} TFLOP/s", fastest_header(result, mode), f"{mode} peak MiB"]
    head += ["pruned", "efficiency"]
    head += ["check"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    graph_base_noted = False
    for name, row in result["providers"].items():
        if "error" in row and not any(m in row for m in modes):
            cells = [name] + ["n/a"] * (len(head) - 2) + [_check_cell(row)]
            lines.append("| " + " | ".join(cells) + " |")
            notes.append(f"{name}: n/a: {row['error']}")
            continue
        cells = [name]
        for mode in modes:
            cells += [
                _cell(row, mode, "ms", ".3f"),
                _cell(row, mode, "tflops", ".1f"),
                _cell(row, mode, "vs_fastest", ".2f"),
                _cell(row, mode, "peak_mib", ".0f"),
            ]
            if "error" in row.get(mode, {}):
                notes.append(f"{name} {mode}: n/a: {row[mode]['error']}")
        cells.append(_fmt(row.get("pruned"), ".3f") if name in PRUNED else "-")
        eff = [f"{mode} {row[mode]['efficiency']:.2f}" for mode in modes if "efficiency" in row.get(mode, {})]
        cells.append(", ".join(eff) if eff else "-")
        cells.append(_check_cell(row))
        lines.append("| " + " | ".join(cells) + " |")
        for n in row.get("notes", []):
            if n.startswith(("pruned fraction n/a", "SDPA's default backend choice")):
                notes.append(f"{name}: {n}")
        graphed = _graph_note(row, modes)
        if graphed and name in SOFTMAX_BASELINES and not graph_base_noted:
            graph_base_noted = True
            base = result.get("fastest_softmax_graph", {})
            notes.append("CUDA-graph ratios are to the fastest softmax baseline's graph time: " + ", ".join(
                f"{mode} {base[mode]['provider']}" for mode in modes if mode in base))
        if graphed:
            notes.append(f"{name}: replayed from a CUDA graph (GPU time, no launches): {graphed}")
        search = row.get("boundary_search")
        if search is not None:
            if "error" in search:
                notes.append(f"{name}: boundary search n/a: {search['error']}")
            else:
                notes.append(
                    f"{name}: boundary search (triton_block_start) {search['search_ms']:.3f} ms"
                    f" = {_fmt(search.get('search_pct_of_acp_fwd'), '.1f')}% of the ACP forward;"
                    f" bound delta (acp_delta, acp={row['acp']['bound']!r})"
                    f" {search['bound_ms']:.3f} ms = {_fmt(search.get('bound_pct_of_acp_fwd'), '.1f')}%"
                    f" (called eagerly; replayed from a CUDA graph, their GPU time:"
                    f" {_fmt(search.get('search_graph_ms'), '.3f')} and"
                    f" {_fmt(search.get('bound_graph_ms'), '.3f')} ms)"
                )
    ref = result.get("reference")
    if ref is not None:
        why = f" ({'; '.join(ref['notes'])})" if ref["notes"] else ""
        grads = f", gradients from {ref['grads_from']}" if ref["grads_from"] else ""
        notes.append(f"check reference: outputs from {ref['out_from']}{grads}{why}")
    out = "\n".join(lines)
    if notes:
        out += "\n\n" + "\n".join(f"- {n}" for n in notes)
    return out


def environment() -> dict:
    import triton

    env = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        import fla

        env["fla"] = fla.__version__
    except Exception as e:
        env["fla"] = f"n/a ({type(e).__name__})"
    try:
        from importlib.metadata import version

        env["lookahead_keys_attention"] = version("lookahead-keys-attention")
    except Exception as e:
        env["lookahead_keys_attention"] = f"n/a ({type(e).__name__})"
    try:
        from importlib.metadata import version

        env["flash_attn_4"] = version("flash-attn-4")
    except Exception as e:
        env["flash_attn_4"] = f"n/a ({type(e).__name__})"
    import lapse

    env["lapse"] = lapse.__version__
    # which kernels lapse's FoX forward and backward run where they serve (dense and ACP on Hopper)
    env["lapse_fox_forward"] = env["lapse_fox_backward"] = "triton"
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        from lapse.ops.forgetting import fa4_bwd, fa4_fwd

        for name, mod in (("forward", fa4_fwd), ("backward", fa4_bwd)):
            if mod.ENABLED and mod._kernels() is not None:
                dims = "/".join(map(str, mod.HEAD_DIMS))
                where = mod.__name__.rsplit(".", 1)[-1]
                env[f"lapse_fox_{name}"] = (f"flash-attn-4 {fa4_bwd.FA4_VERSION} where {where}.serves takes "
                                            f"the call (16-bit, D {dims}, no packing), else triton")
    return env


def _jsonable(x):
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, torch.dtype):
        return str(x)
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def run(cfg: AttentionBenchConfig) -> dict:
    """Runs the benchmark, prints the Markdown tables and writes results.json/.md."""
    from tqdm.auto import tqdm

    if not torch.cuda.is_available():
        raise SystemExit("lapse bench attention needs a CUDA GPU (none is visible)")
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"lapse bench attention needs triton ({e})") from e
    # FlexAttention is compiled once per shape and grad mode (and again for the check);
    # keep dynamo from falling back to eager flex (very slow) after its default limit.
    import torch._dynamo as dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo.config, name):
            setattr(dynamo.config, name, max(64, getattr(dynamo.config, name)))

    # The log-gate value check reads a flag back to the host (a sync per call); a model's
    # logsigmoid gates cannot fail it, and SDPA/Flex/fla check nothing, so time without it.
    from lapse.ops.forgetting import set_value_checks

    set_value_checks(False)
    specs = cfg.specs()
    label = specs[0].label if cfg.varlen else specs[0].label.rsplit("-T", 1)[0]
    out_dir = cfg.out_dir or Path("runs/bench/attention") / label
    env = environment()
    commit = cfg.commit or git_commit()
    report = {
        "benchmark": "attention",
        **env,
        "commit": commit,
        "command": cfg.command(),
        "config": dataclasses.asdict(cfg),
        "flop_formula": FLOP_FORMULA,
        "timing": "triton.testing.do_bench, median; fwd under no_grad; fwd+bwd = forward + "
        "autograd.grad of all differentiable inputs (gates included) under a fixed random dO; "
        "lapse with set_value_checks(False) (no host sync for the log-gate value check)",
        "workloads": [],
    }
    md = [
        f"# lapse bench attention: {label}",
        "",
        f"{env['device']}, torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, "
        f"fla {env['fla']}, flash-attn-4 {env.get('flash_attn_4', 'n/a')}, lapse {env['lapse']}, "
        f"commit {commit or 'unknown'}, {env['date']}; lapse's FoX forward: "
        f"{env.get('lapse_fox_forward', 'triton')}; backward: {env.get('lapse_fox_backward', 'triton')}",
        "",
        f"`{cfg.command()}`",
        "",
        f"TFLOP/s: {FLOP_FORMULA}. Times: median ms of do_bench. x fastest softmax (NAME): "
        "time ratio to the fastest softmax baseline (SDPA's backends and FlashAttention-4, no "
        "gate) that ran in that workload and mode, named in the header. "
        "efficiency = t_dense * (1 - pruned) / t_acp.",
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    # beside results.md, under the same device line and command: the kernels of each call
    # (--profile), the FoX kernels' tile options (--sweep)
    pages = {f"{page}.md": [f"# lapse bench attention --{page}: {label}", *md[1:5]]
             for page, wanted in (("profile", cfg.profile), ("sweep", cfg.sweep)) if wanted}
    with tqdm(total=len(specs) * len(cfg.providers), desc="bench attention") as progress:
        for spec in specs:
            res = bench_workload(spec, cfg, progress)
            report["workloads"].append(res)
            if spec.varlen:
                title = "varlen, lengths " + " + ".join(map(str, spec.seqlens))
            else:
                title = f"T = {spec.seq_len}, B = {spec.batch}"
            table = markdown_table(res, cfg.modes)
            md += ["", f"## {title}", "", table]
            tqdm.write(f"\n## {spec.label}\n\n{table}\n")
            if "profile.md" in pages:
                pages["profile.md"] += ["", f"## {title}", "", profile_markdown(res, cfg.modes)]
            if "sweep.md" in pages:
                from .sweep import sweep_markdown

                swept = sweep_markdown(res["sweep"]) if "sweep" in res else f"n/a: {res.get('sweep_error')}"
                pages["sweep.md"] += ["", f"## {title}", "", swept]
            # after every workload: a run cut off (a time limit, a crash) keeps what it measured
            write_text_atomic(out_dir / "results.json", json.dumps(_jsonable(report), indent=2) + "\n")
            write_text_atomic(out_dir / "results.md", "\n".join(md) + "\n")
            for page, lines in pages.items():
                write_text_atomic(out_dir / page, "\n".join(lines) + "\n")
            _free()
    print(f"wrote {', '.join(str(out_dir / f) for f in ['results.json', 'results.md', *pages])}")
    return report
