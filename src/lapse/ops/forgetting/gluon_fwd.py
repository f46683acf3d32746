"""The FoX forward on Hopper in Gluon, with the next tile's ``Q K^T`` in flight during this
tile's softmax: dense (:func:`launch`, below), and with ACP as a persistent kernel
(:func:`launch_acp`, at the end of the file).

Triton's own compiler waits on every ``Q K^T`` product right after issuing it: in
``triton_fwd.py`` compiled for sm_90, even a loop that computes the next tile's logits
one step ahead gets ``wgmma.wait_group 0`` straight after the product, so the tensor
cores sit idle while the softmax runs. Gluon (Triton's lower-level dialect, shipped with
Triton) issues the products asynchronously and lets the kernel say when to wait. Per key
tile ``j`` the order is (``wait(n)``: until at most ``n`` products are in flight)::

    issue S_{j+1} = Q K_{j+1}^T          in flight: S_j, PV_{j-1}, S_{j+1}
    wait(2)   -> S_j done                 prefetch K_{j+STAGES} into S_j's buffer
    softmax of S_j (bias, max, exp2)      runs beside PV_{j-1} and S_{j+1}
    wait(1)   -> PV_{j-1} done            prefetch V_{j-1+STAGES}
    acc *= alpha; issue PV_j = P_j V_j

A one-warp load partition (``gl.warp_specialize``) brings Q once and every key and value
tile through the tensor-memory engine (TMA) into ``STAGES`` ring buffers, each with a
"ready" barrier (the copy landed) and an "empty" one (the compute partition released
it). The keys' bias ``c_j`` is loaded one tile ahead. The last step issues one product
past the end (the last tile again: its result is dropped) so every step has the same
shape. ``SPLIT`` runs two compute partitions of 4 warps, each with half the query rows,
against one of ``num_warps``.

Status: correct (its GPU tests hold
it to the float64 oracle) but not yet faster than the Triton kernel. On an H200 (bf16,
B x T = 32k, T 4k / 16k) its best options (4 warps, 64-row tiles, two programs a
multiprocessor) take 1.69 / 6.12 ms at D 64 and 1.18 / 4.37 ms at D 128 against the
Triton kernel's 1.45 / 5.11 and 1.24 / 4.11. So it stays opt-in (``GLUON=True`` in the
forward's config): the start for FA3's ping-pong of two compute partitions, which the
Triton compiler cannot express.

Scope of the dense kernel: no ACP, ``T_q == T_k``, no varlen, bf16 or fp16, D 64 or 128, tensors
``[B, T, H, D]`` contiguous and 16-byte aligned. ``triton_fwd.launch_fwd`` takes this path where
:func:`supported` holds and the config asks for it; the Triton kernel is the fallback
and the reference the GPU tests hold it to. There is no CPU interpreter for Gluon.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..backend import LOG2E, LOG2E_TL, cuda_capability, tma_ready
from .common import ACP_BLOCK


@gluon.jit
def _key_bias(p_chi, p_clo, c_ref, j, T, BN: gl.constexpr, s_layout: gl.constexpr):
    """Tile ``j``'s key positions and their ``c_j`` (base 2, relative to ``c_ref``)."""
    o_n = j * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
    m_n = o_n < T
    b_ck = (gl.load(p_chi + o_n, mask=m_n, other=0.0) - c_ref) + gl.load(p_clo + o_n, mask=m_n, other=0.0)
    b_ck = b_ck * LOG2E_TL
    return o_n, b_ck


@gluon.jit
def _softmax_step(b_s, m_i, l_i, b_ck, o_m, o_n, masked, qk_scale, BIAS: gl.constexpr):
    """A tile's probabilities (unnormalised, against the running max) and the new row
    state: ``(p, alpha, m, l)``. The logits leave out the query's own ``c_i`` (a per-row
    constant the softmax does not see; the lse takes it back): one fused multiply-add per
    pair for the scale and the bias."""
    if BIAS:
        b_s = b_s * qk_scale - b_ck[None, :]
    else:  # plain causal softmax attention: a timing diagnostic only (BIAS=False)
        b_s = b_s * qk_scale
    if masked:  # the tiles that reach the diagonal: causal mask
        b_s = gl.where(o_n[None, :] <= o_m[:, None], b_s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(b_s, 1))
    b_p = gl.exp2(b_s - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(b_p, 1)
    return b_p, alpha, m_new, l_i


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_empty, v_empty,
            q_row, kv_row, q_col, kv_col, n, BN: gl.constexpr, STAGES: gl.constexpr):
    """The load partition (one warp): Q once, then every key and value tile through TMA,
    each into its ring buffer once the compute partition has released it."""
    mbarrier.expect(q_ready, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_ready, q_smem)
    for j in range(n):
        st = j % STAGES
        ph = ((j // STAGES) & 1) ^ 1  # the release of this buffer's previous tile
        mbarrier.wait(k_empty.index(st), ph, pred=j >= STAGES)
        mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row + j * BN, kv_col], k_ready.index(st),
                                        k_smem.index(st))
        mbarrier.wait(v_empty.index(st), ph, pred=j >= STAGES)
        mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [kv_row + j * BN, kv_col], v_ready.index(st),
                                        v_smem.index(st))


@gluon.jit
def _compute(q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_empty, v_empty, CHI, CLO, O, LSE,
             qk_scale, T, TC, HQ, i_b, i_h, m0, n,
             D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
             num_warps: gl.constexpr, BIAS: gl.constexpr):
    """The compute partition: logits, softmax, ``P V`` and the output rows."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    dtype: gl.constexpr = q_smem.dtype
    n_full = m0 // BN  # tiles before the diagonal: no mask

    # the bias: cumulative gates relative to the tile's first query (triton_fwd.py)
    p_chi = CHI + (i_b * HQ + i_h) * TC
    p_clo = CLO + (i_b * HQ + i_h) * TC
    c_ref = gl.load(p_chi + m0)
    o_m = m0 + gl.arange(0, BM, layout=row_s)
    o_mc = gl.minimum(o_m, T - 1)
    b_cq = ((gl.load(p_chi + o_mc) - c_ref) + gl.load(p_clo + o_mc)) * LOG2E_TL

    zero_s = gl.zeros([BM, BN], gl.float32, s_layout)
    acc = gl.zeros([BM, D], gl.float32, o_layout)
    m_i = gl.full([BM], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BM], gl.float32, row_s)

    o_n, b_ck = _key_bias(p_chi, p_clo, c_ref, 0, T, BN, s_layout)
    mbarrier.wait(q_ready, 0)
    mbarrier.wait(k_ready.index(0), 0)
    s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)

    # step 0: nothing to rescale, no PV in flight
    jn = gl.minimum(1, n - 1)
    mbarrier.wait(k_ready.index(jn % STAGES), (jn // STAGES) & 1)
    s_next = warpgroup_mma(q_smem, k_smem.index(jn % STAGES).permute((1, 0)), zero_s, use_acc=False,
                           is_async=True)
    o_nn, b_ckn = _key_bias(p_chi, p_clo, c_ref, jn, T, BN, s_layout)
    b_s = warpgroup_mma_wait(1, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(0), count=1, pred=n > 1)
    b_p, alpha, m_i, l_i = _softmax_step(b_s, m_i, l_i, b_ck, o_m, o_n, n_full == 0, qk_scale,
                                         BIAS)
    mbarrier.wait(v_ready.index(0), 0)
    pv_tok = warpgroup_mma(gl.convert_layout(b_p.to(dtype), p_layout), v_smem.index(0), acc, is_async=True)
    s_tok = s_next
    o_n, b_ck = o_nn, b_ckn

    for j in range(1, n):
        st = j % STAGES
        jn = gl.minimum(j + 1, n - 1)
        mbarrier.wait(k_ready.index(jn % STAGES), (jn // STAGES) & 1)
        s_next = warpgroup_mma(q_smem, k_smem.index(jn % STAGES).permute((1, 0)), zero_s, use_acc=False,
                               is_async=True)
        o_nn, b_ckn = _key_bias(p_chi, p_clo, c_ref, jn, T, BN, s_layout)
        b_s = warpgroup_mma_wait(2, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(st), count=1, pred=j + 1 < n)  # S_j done: release K_j
        b_p, alpha, m_i, l_i = _softmax_step(b_s, m_i, l_i, b_ck, o_m, o_n, j >= n_full,
                                             qk_scale, BIAS)
        acc = warpgroup_mma_wait(1, deps=(pv_tok, ))
        mbarrier.arrive(v_empty.index((j - 1) % STAGES), count=1)  # PV_{j-1} done: release V_{j-1}
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        mbarrier.wait(v_ready.index(st), (j // STAGES) & 1)
        pv_tok = warpgroup_mma(gl.convert_layout(b_p.to(dtype), p_layout), v_smem.index(st), acc,
                               is_async=True)
        s_tok = s_next
        o_n, b_ck = o_nn, b_ckn

    acc, b_s = warpgroup_mma_wait(0, deps=(pv_tok, s_tok))
    l_o = gl.convert_layout(l_i, row_o)
    b_o = acc / l_o[:, None]
    o_mo = m0 + gl.arange(0, BM, layout=row_o)
    o_d = gl.arange(0, D, layout=col_o)
    p_o = O + ((i_b * T + o_mo[:, None]) * HQ + i_h) * D + o_d[None, :]
    gl.store(p_o, b_o.to(dtype), mask=(o_mo < T)[:, None])
    # log-sum-exp in base 2 of the true logits (the ref shift cancels between c_i and c_j)
    gl.store(LSE + (i_b * HQ + i_h) * TC + o_m, m_i + gl.log2(l_i) + b_cq, mask=o_m < T)


@gluon.jit
def _fwd_kernel(q_desc, k_desc, v_desc, CHI, CLO, O, LSE, qk_scale, T, TC, HQ, GROUP,
                D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                SPLIT: gl.constexpr, COMPUTE_REGS: gl.constexpr, num_warps: gl.constexpr,
                BIAS: gl.constexpr = True):
    # the last query tiles have the most keys: schedule them first
    i_m = gl.num_programs(0) - 1 - gl.program_id(0)
    i_bh = gl.program_id(1)
    i_b = i_bh // HQ
    i_h = i_bh % HQ
    m0 = i_m * BM
    n = gl.cdiv(gl.minimum(m0 + BM, T), BN)  # key tiles of this query tile (causal)
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [BM, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, D], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=2 if SPLIT else 1)  # one arrive per compute partition
        mbarrier.init(v_empty.index(s), count=2 if SPLIT else 1)
    # rows of this sequence in the [B * T, H * D] views
    if SPLIT:  # two compute partitions of 4 warps, each with half the query rows
        HM: gl.constexpr = BM // 2
        gl.warp_specialize([
            (_compute, (q_smem.slice(0, HM), k_smem, v_smem, q_ready, k_ready, v_ready, k_empty, v_empty, CHI,
                        CLO, O, LSE, qk_scale, T, TC, HQ, i_b, i_h, m0, n, D, HM, BN, STAGES, num_warps,
                        BIAS)),
            (_compute, (q_smem.slice(HM, HM), k_smem, v_smem, q_ready, k_ready, v_ready, k_empty, v_empty,
                        CHI, CLO, O, LSE, qk_scale, T, TC, HQ, i_b, i_h, m0 + HM, n, D, HM, BN, STAGES, 4,
                        BIAS)),
            (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_empty,
                       v_empty, i_b * T + m0, i_b * T, i_h * D, (i_h // GROUP) * D, n, BN, STAGES)),
        ], [4, 1], [COMPUTE_REGS, 24])
    else:
        gl.warp_specialize([
            (_compute, (q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_empty, v_empty, CHI, CLO, O, LSE,
                        qk_scale, T, TC, HQ, i_b, i_h, m0, n, D, BM, BN, STAGES, num_warps, BIAS)),
            (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, k_empty,
                       v_empty, i_b * T + m0, i_b * T, i_h * D, (i_h // GROUP) * D, n, BN, STAGES)),
        ], [1], [24])


def gluon_config(d: int) -> dict:
    """Tiles, warps and buffers by head dim: the fastest of a sweep of its options on an H200
    (bf16, B x T = 32k, T 4k / 16k): one 4-warp compute partition on 64-row tiles with 128
    registers per thread at launch (``maxnreg``), so that two programs share a
    multiprocessor. ``SPLIT``: two compute partitions of 4 warps instead of one of
    ``num_warps``; ``COMPUTE_REGS`` the second one's registers per thread."""
    return dict(BM=64, BN=64, num_warps=4, STAGES=3 if d <= 64 else 2, SPLIT=False, COMPUTE_REGS=0,
                maxnreg=128)


def supported(q, k, v, block_start, cu, p) -> bool:
    """Whether :func:`launch` serves these inputs (else the Triton kernel does)."""
    return (q.is_cuda and cuda_capability(q)[0] == 9
            and block_start is None and cu is None and p.tq == p.tk
            and q.dtype in (torch.bfloat16, torch.float16) and q.dtype == k.dtype == v.dtype
            and p.d in (64, 128) and all(x.is_contiguous() for x in (q, k, v)) and tma_ready(q, k, v)
            and q.numel() < 2**31)  # 32-bit offsets in the kernel


def _descriptors(q, k, v, bm: int, bn: int):
    """TMA descriptors over ``[B * T, H * D]`` views of ``q``, ``k``, ``v``: a block is ``bm``
    (queries) or ``bn`` (keys, values) rows of one head's D columns."""
    b, t, hq, d = q.shape
    h = k.shape[2]
    el = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q2, k2, v2 = q.view(b * t, hq * d), k.view(b * t, h * d), v.view(b * t, h * d)
    q_desc = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [bm, d],
                              gl.NVMMASharedLayout.get_default_for([bm, d], el))
    kv_layout = gl.NVMMASharedLayout.get_default_for([bn, d], el)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [bn, d], kv_layout)
    v_desc = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [bn, d], kv_layout)
    return q_desc, k_desc, v_desc


def launch(q, k, v, c_hi, c_lo, p, o, lse2, config=None) -> None:
    """Writes ``o`` ``[B, T, HQ, D]`` and the base-2 lse ``[B, HQ, Tc]`` (:func:`supported`
    inputs only)."""
    cfg = dict(config or gluon_config(p.d))
    bm, bn = cfg.pop("BM"), cfg.pop("BN")
    cfg.setdefault("SPLIT", False)
    cfg.setdefault("COMPUTE_REGS", 232 if cfg["SPLIT"] else 0)
    if cfg.get("maxnreg") is None:  # registers per thread at launch (the partitions then move them)
        cfg.pop("maxnreg", None)
    b, t, hq, d = q.shape
    h = k.shape[2]
    q_desc, k_desc, v_desc = _descriptors(q, k, v, bm, bn)
    grid = (triton.cdiv(t, bm), b * hq)
    _fwd_kernel[grid](q_desc, k_desc, v_desc, c_hi, c_lo, o, lse2, p.scale * LOG2E, t, c_hi.shape[-1], hq,
                      hq // h, D=d, BM=bm, BN=bn, **cfg)


# --- ACP's forward as a persistent kernel (opt-in) -----------------------------------------
#
# With ACP the local heads' query tiles keep 1-14 key tiles each, so a program a tile spends
# most of its time starting and ending (the Q load, the first K/V loads, the O store). Here a
# few programs a multiprocessor loop over the query tiles, and the one-warp load partition runs
# ahead across tiles: it brings the next tile's Q (two buffers) and keys while the compute
# partition still finishes this one, so one tile's end overlaps the next one's start. The
# ring buffers' phases count key tiles across the whole loop.
#
# Status: correct (its GPU tests hold it to the
# float64 oracle). On an H200, as the routed launch of the bench workload's local heads, it is
# 10-26% faster than the Triton kernel at D 128 (0.219-0.226 ms against 0.244-0.305 at T 4k-16k)
# and 29-32% slower at D 64 (0.263-0.275 against 0.204-0.209): Gluon pads the one-warp load
# partition to a 4-warp group, so a program is 8 warps and at 128 registers only two fit a
# multiprocessor where the Triton kernel runs four; ptxas allocates the whole kernel at
# ``maxnreg``, so more consumers a program only trade that for spills. So the D 128 ACP table
# takes it for its routed launch (``GLUON_ACP="routed"`` in ``triton_fwd.fwd_config``: the op's
# forward 2-6% faster on an H100), and elsewhere it is opt-in (``GLUON_ACP`` a dict of options).


@gluon.jit
def _acp_item(w, n_tiles, BH, HQ, BSTART, MB, T, BM: gl.constexpr, BN: gl.constexpr,
              SKIP_FULL: gl.constexpr):
    """Item ``w`` of the persistent loop: its query tile, sequence and head, first kept key
    tile, number of key tiles, and whether it is skipped (``SKIP_FULL``: a (sequence, head)
    that ACP prunes nowhere, which another launch serves). Heads first and the longest tiles
    first."""
    i_bh = w % BH
    i_m = n_tiles - 1 - w // BH
    p_bs = BSTART + i_bh * MB
    j0 = gl.load(p_bs + i_m) * (BM // BN)  # BM is the ACP block: one start for the tile's rows
    n = gl.cdiv(gl.minimum(i_m * BM + BM, T), BN) - j0
    if SKIP_FULL:
        skip = gl.load(p_bs + (T - 1) // BM) == 0
    else:
        skip = n < 0
    return i_m, i_bh // HQ, i_bh % HQ, j0, n, skip


@gluon.jit
def _acp_items(n_items, C: gl.constexpr, NC: gl.constexpr):
    """The run of consecutive items that consumer ``C`` of this program serves: runs of
    consecutive items take every head in turn, so the consumers get about equal work (a stride
    of programs would give each one the same few heads, and a head's window sets its work)."""
    per = gl.cdiv(n_items, gl.num_programs(0) * NC)
    lo = (gl.program_id(0) * NC + C) * per
    return lo, gl.minimum(lo + per, n_items)


@gluon.jit
def _acp_loader(descs, bufs, args, D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                SKIP_FULL: gl.constexpr, C: gl.constexpr, NC: gl.constexpr):
    """The load partition of consumer ``C`` (one warp): each kept tile's Q into one of two
    buffers, then its kept keys and values into the rings, running ahead of the compute
    partition by the buffers."""
    q_desc, k_desc, v_desc = descs
    q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty = bufs
    BSTART, T, MB, HQ, GROUP, BH, n_tiles, n_items = args
    kv = 0
    it = 0
    lo, hi = _acp_items(n_items, C, NC)
    for w in range(lo, hi):
        i_m, i_b, i_h, j0, n, skip = _acp_item(w, n_tiles, BH, HQ, BSTART, MB, T, BM, BN, SKIP_FULL)
        if not skip:
            qb = C * 2 + it % 2
            mbarrier.wait(q_empty.index(qb), ((it // 2) & 1) ^ 1, pred=it >= 2)
            mbarrier.expect(q_ready.index(qb), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [i_b * T + i_m * BM, i_h * D], q_ready.index(qb),
                                            q_smem.index(qb))
            kv_row = i_b * T + j0 * BN
            kv_col = (i_h // GROUP) * D
            for j in range(n):
                c = kv + j
                st = C * STAGES + c % STAGES
                ph = ((c // STAGES) & 1) ^ 1
                mbarrier.wait(k_empty.index(st), ph, pred=c >= STAGES)
                mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [kv_row + j * BN, kv_col], k_ready.index(st),
                                                k_smem.index(st))
                mbarrier.wait(v_empty.index(st), ph, pred=c >= STAGES)
                mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(v_desc, [kv_row + j * BN, kv_col], v_ready.index(st),
                                                v_smem.index(st))
            kv += n
            it += 1


@gluon.jit
def _acp_compute(bufs, ptrs, args, D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                 SKIP_FULL: gl.constexpr, C: gl.constexpr, NC: gl.constexpr):
    """The compute partition of consumer ``C`` (4 warps): each kept tile's logits, softmax
    and ``P V`` as in :func:`_compute` (the next key tile's ``Q K^T`` in flight during this
    one's softmax), drained at the tile's end, which releases its last buffers and its Q."""
    q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty = bufs
    CHI, CLO, BSTART, O, LSE = ptrs
    qk_scale, T, TC, MB, HQ, GROUP, BH, n_tiles, n_items = args
    num_warps: gl.constexpr = 4
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    dtype: gl.constexpr = q_smem.dtype
    zero_s = gl.zeros([BM, BN], gl.float32, s_layout)
    kv = 0
    it = 0
    lo, hi = _acp_items(n_items, C, NC)
    for w in range(lo, hi):
        i_m, i_b, i_h, j0, n, skip = _acp_item(w, n_tiles, BH, HQ, BSTART, MB, T, BM, BN, SKIP_FULL)
        if not skip:
            m0 = i_m * BM
            n_full = i_m * (BM // BN) - j0  # kept tiles before the diagonal: no mask
            p_chi = CHI + (i_b * HQ + i_h) * TC
            p_clo = CLO + (i_b * HQ + i_h) * TC
            c_ref = gl.load(p_chi + m0)
            o_m = m0 + gl.arange(0, BM, layout=row_s)
            o_mc = gl.minimum(o_m, T - 1)
            b_cq = ((gl.load(p_chi + o_mc) - c_ref) + gl.load(p_clo + o_mc)) * LOG2E_TL
            acc = gl.zeros([BM, D], gl.float32, o_layout)
            m_i = gl.full([BM], float("-inf"), gl.float32, row_s)
            l_i = gl.zeros([BM], gl.float32, row_s)
            qb = C * 2 + it % 2
            q_cur = q_smem.index(qb)
            o_n, b_ck = _key_bias(p_chi, p_clo, c_ref, j0, T, BN, s_layout)
            mbarrier.wait(q_ready.index(qb), (it // 2) & 1)
            s0 = C * STAGES + kv % STAGES
            mbarrier.wait(k_ready.index(s0), (kv // STAGES) & 1)
            s_tok = warpgroup_mma(q_cur, k_smem.index(s0).permute((1, 0)), zero_s, use_acc=False,
                                  is_async=True)
            cn = kv + gl.minimum(1, n - 1)
            sn = C * STAGES + cn % STAGES
            mbarrier.wait(k_ready.index(sn), (cn // STAGES) & 1)
            s_next = warpgroup_mma(q_cur, k_smem.index(sn).permute((1, 0)), zero_s, use_acc=False,
                                   is_async=True)
            o_nn, b_ckn = _key_bias(p_chi, p_clo, c_ref, j0 + gl.minimum(1, n - 1), T, BN, s_layout)
            b_s = warpgroup_mma_wait(1, deps=(s_tok, ))
            mbarrier.arrive(k_empty.index(s0), count=1, pred=n > 1)
            b_p, alpha, m_i, l_i = _softmax_step(b_s, m_i, l_i, b_ck, o_m, o_n, n_full == 0, qk_scale, True)
            mbarrier.wait(v_ready.index(s0), (kv // STAGES) & 1)
            pv_tok = warpgroup_mma(gl.convert_layout(b_p.to(dtype), p_layout), v_smem.index(s0), acc,
                                   is_async=True)
            s_tok = s_next
            o_n, b_ck = o_nn, b_ckn
            for j in range(1, n):
                c = kv + j
                st = C * STAGES + c % STAGES
                jn = gl.minimum(j + 1, n - 1)
                cn = kv + jn
                sn = C * STAGES + cn % STAGES
                mbarrier.wait(k_ready.index(sn), (cn // STAGES) & 1)
                s_next = warpgroup_mma(q_cur, k_smem.index(sn).permute((1, 0)), zero_s, use_acc=False,
                                       is_async=True)
                o_nn, b_ckn = _key_bias(p_chi, p_clo, c_ref, j0 + jn, T, BN, s_layout)
                b_s = warpgroup_mma_wait(2, deps=(s_tok, ))
                mbarrier.arrive(k_empty.index(st), count=1, pred=j + 1 < n)  # S_j done: release K_j
                b_p, alpha, m_i, l_i = _softmax_step(b_s, m_i, l_i, b_ck, o_m, o_n, j >= n_full, qk_scale,
                                                     True)
                acc = warpgroup_mma_wait(1, deps=(pv_tok, ))
                mbarrier.arrive(v_empty.index(C * STAGES + (c - 1) % STAGES), count=1)  # PV_{j-1} done
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                mbarrier.wait(v_ready.index(st), (c // STAGES) & 1)
                pv_tok = warpgroup_mma(gl.convert_layout(b_p.to(dtype), p_layout), v_smem.index(st), acc,
                                       is_async=True)
                s_tok = s_next
                o_n, b_ck = o_nn, b_ckn
            acc, b_s = warpgroup_mma_wait(0, deps=(pv_tok, s_tok))
            cl = C * STAGES + (kv + n - 1) % STAGES  # the last key tile (read twice), its values, Q
            mbarrier.arrive(k_empty.index(cl), count=1)
            mbarrier.arrive(v_empty.index(cl), count=1)
            mbarrier.arrive(q_empty.index(qb), count=1)
            l_o = gl.convert_layout(l_i, row_o)
            b_o = acc / l_o[:, None]
            o_mo = m0 + gl.arange(0, BM, layout=row_o)
            o_d = gl.arange(0, D, layout=col_o)
            p_o = O + ((i_b * T + o_mo[:, None]) * HQ + i_h) * D + o_d[None, :]
            gl.store(p_o, b_o.to(dtype), mask=(o_mo < T)[:, None])
            gl.store(LSE + (i_b * HQ + i_h) * TC + o_m, m_i + gl.log2(l_i) + b_cq, mask=o_m < T)
            kv += n
            it += 1


@gluon.jit
def _acp_kernel(q_desc, k_desc, v_desc, CHI, CLO, BSTART, O, LSE, qk_scale, T, TC, MB, HQ, GROUP, BH, n_tiles,
                n_items, D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                num_warps: gl.constexpr, SKIP_FULL: gl.constexpr, NC: gl.constexpr,
                COMPUTE_REGS: gl.constexpr):
    # NC consumers, each a 4-warp compute partition with its own load warp, buffers and items
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [NC * 2, BM, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NC * STAGES, BN, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NC * STAGES, BN, D], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [NC * 2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NC * 2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NC * STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NC * STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NC * STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NC * STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NC * 2):
        mbarrier.init(q_ready.index(s), count=1)
        mbarrier.init(q_empty.index(s), count=1)
    for s in gl.static_range(NC * STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=1)
        mbarrier.init(v_empty.index(s), count=1)
    bufs = (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty)
    descs = (q_desc, k_desc, v_desc)
    ptrs = (CHI, CLO, BSTART, O, LSE)
    args = (qk_scale, T, TC, MB, HQ, GROUP, BH, n_tiles, n_items)
    largs = (BSTART, T, MB, HQ, GROUP, BH, n_tiles, n_items)
    if NC == 1:
        gl.warp_specialize([(_acp_compute, (bufs, ptrs, args, D, BM, BN, STAGES, SKIP_FULL, 0, NC)),
                            (_acp_loader, (descs, bufs, largs, D, BM, BN, STAGES, SKIP_FULL, 0, NC))],
                           [1], [24])
    elif NC == 2:
        gl.warp_specialize([(_acp_compute, (bufs, ptrs, args, D, BM, BN, STAGES, SKIP_FULL, 0, NC)),
                            (_acp_compute, (bufs, ptrs, args, D, BM, BN, STAGES, SKIP_FULL, 1, NC)),
                            (_acp_loader, (descs, bufs, largs, D, BM, BN, STAGES, SKIP_FULL, 0, NC)),
                            (_acp_loader, (descs, bufs, largs, D, BM, BN, STAGES, SKIP_FULL, 1, NC))],
                           [4, 1, 1], [COMPUTE_REGS, 24, 24])
    elif NC == 3:
        gl.warp_specialize([(_acp_compute, (bufs, ptrs, args, D, BM, BN, STAGES, SKIP_FULL, 0, NC)),
                            (_acp_compute, (bufs, ptrs, args, D, BM, BN, STAGES, SKIP_FULL, 1, NC)),
                            (_acp_compute, (bufs, ptrs, args, D, BM, BN, STAGES, SKIP_FULL, 2, NC)),
                            (_acp_loader, (descs, bufs, largs, D, BM, BN, STAGES, SKIP_FULL, 0, NC)),
                            (_acp_loader, (descs, bufs, largs, D, BM, BN, STAGES, SKIP_FULL, 1, NC)),
                            (_acp_loader, (descs, bufs, largs, D, BM, BN, STAGES, SKIP_FULL, 2, NC))],
                           [4, 4, 1, 1, 1], [COMPUTE_REGS, COMPUTE_REGS, 24, 24, 24])
    else:
        gl.static_assert(NC == 4, "1 to 4 consumers")
        gl.warp_specialize([(_acp_compute, (bufs, ptrs, args, D, BM, BN, STAGES, SKIP_FULL, 0, NC)),
                            (_acp_compute, (bufs, ptrs, args, D, BM, BN, STAGES, SKIP_FULL, 1, NC)),
                            (_acp_compute, (bufs, ptrs, args, D, BM, BN, STAGES, SKIP_FULL, 2, NC)),
                            (_acp_compute, (bufs, ptrs, args, D, BM, BN, STAGES, SKIP_FULL, 3, NC)),
                            (_acp_loader, (descs, bufs, largs, D, BM, BN, STAGES, SKIP_FULL, 0, NC)),
                            (_acp_loader, (descs, bufs, largs, D, BM, BN, STAGES, SKIP_FULL, 1, NC)),
                            (_acp_loader, (descs, bufs, largs, D, BM, BN, STAGES, SKIP_FULL, 2, NC)),
                            (_acp_loader, (descs, bufs, largs, D, BM, BN, STAGES, SKIP_FULL, 3, NC))],
                           [4, 4, 4, 1, 1, 1, 1], [COMPUTE_REGS, COMPUTE_REGS, COMPUTE_REGS, 24, 24, 24, 24])


def acp_config(d: int) -> dict:
    """The persistent ACP forward's options by head dim: 64-row tiles (one ACP block), ``NC``
    consumers a program (each a 4-warp compute partition with ``COMPUTE_REGS`` registers a
    thread and a load warp; the load warps take one 4-warp group's registers), ``PROGRAMS`` a
    multiprocessor, ``maxnreg`` registers a thread at launch. The fastest of a sweep of these
    options on an H200 (the bench's workload, the routed launch's heads): at D 64 four programs
    a multiprocessor (two resident: a program is 8 warps), at D 128 two (its shared memory)."""
    return dict(BM=64, BN=64, num_warps=4, STAGES=3 if d <= 64 else 2, NC=1, PROGRAMS=4 if d <= 64 else 2,
                maxnreg=128)


def acp_supported(q, k, v, block_start, cu, p) -> bool:
    """Whether :func:`launch_acp` serves these inputs (ACP on Hopper, as :func:`supported`
    otherwise)."""
    return (block_start is not None and q.is_cuda and cuda_capability(q)[0] == 9
            and cu is None and p.tq == p.tk
            and q.dtype in (torch.bfloat16, torch.float16) and q.dtype == k.dtype == v.dtype
            and p.d in (64, 128) and all(x.is_contiguous() for x in (q, k, v)) and tma_ready(q, k, v)
            and q.numel() < 2**31)  # 32-bit offsets in the kernel


@functools.cache
def _multiprocessors(device: int | None) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_acp(q, k, v, c_hi, c_lo, block_start, p, o, lse2, config=None, skip_full=False) -> None:
    """Writes ``o`` and the base-2 lse of ACP's forward (:func:`acp_supported` inputs) with the
    persistent kernel; ``skip_full``: only the (sequence, head)s that ACP prunes somewhere.
    Without it every head runs here, and the programs' runs of items, which go from the longest
    tiles to the shortest, balance badly where heads keep every key (a diagnostic, not a path
    the tables take)."""
    cfg = dict(config or acp_config(p.d))
    bm, bn, programs = cfg.pop("BM"), cfg.pop("BN"), cfg.pop("PROGRAMS")
    cfg.setdefault("NC", 1)
    if cfg["NC"] == 1:
        cfg.setdefault("COMPUTE_REGS", 24)  # unused with one consumer
    # the kernel's assumptions: a query tile is one ACP block (one first kept key for its rows),
    # a key tile divides it, the lookahead holds two key tiles, one 4-warp compute layout
    if not (bm == ACP_BLOCK and ACP_BLOCK % bn == 0 and cfg["STAGES"] >= 2 and cfg["num_warps"] == 4
            and 1 <= cfg["NC"] <= 4 and "COMPUTE_REGS" in cfg):
        raise ValueError(f"launch_acp needs BM={ACP_BLOCK}, BN dividing it, STAGES >= 2, num_warps=4, NC 1-4 "
                         f"and COMPUTE_REGS with NC > 1; got {config}")
    if cfg.get("maxnreg") is None:  # registers per thread at launch (the partitions then move them)
        cfg.pop("maxnreg", None)
    b, t, hq, d = q.shape
    h = k.shape[2]
    q_desc, k_desc, v_desc = _descriptors(q, k, v, bm, bn)
    n_tiles = triton.cdiv(t, bm)
    n_items = n_tiles * b * hq
    grid = (min(n_items, _multiprocessors(q.device.index) * programs), )
    _acp_kernel[grid](q_desc, k_desc, v_desc, c_hi, c_lo, block_start, o, lse2, p.scale * LOG2E, t,
                      c_hi.shape[-1], block_start.shape[-1], hq, hq // h, b * hq, n_tiles, n_items, D=d,
                      BM=bm, BN=bn, SKIP_FULL=skip_full, **cfg)
