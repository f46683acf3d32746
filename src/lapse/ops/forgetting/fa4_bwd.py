"""FoX's backward on FlashAttention-4's Hopper kernel, where ``flash-attn-4`` is installed.

FlashAttention-4's ``FlashAttentionBackwardSm90`` (warp-specialised: a producer warp brings Q,
dO and the statistics by TMA, two consumer warpgroups overlap one tile's products with the next
one's softmax) calls two hooks on each score tile: ``apply_score_mod`` after ``S = K Q^T`` (the
tiles are transposed, ``SdP_swapAB``: a thread holds keys as rows) and ``apply_score_mod_bwd``
on the tile of ``dS``. A subclass fills them with FoX (SPEC section 1), and everything else is
FlashAttention-4's own:

- **the bias.** A row's constant cancels in its softmax, so a query tile uses ``c_ref``, the gate
  sum at its last row, instead of ``c_i``, and the lse given to the kernel loses ``c_i - c_ref``.
  Key ``j``'s term ``c_ref - c_j`` is one number a tile pair (``c_ref - c_kref`` from the
  double-float ``c_hi + c_lo``, ``kref`` the key tile's last key) plus ``d_j = c_kref - c_j``,
  small (the decay within one tile) and made on the device in float32 (:func:`column_terms`).
  A score costs one multiply-add, ``s * scale + bias_j``.
- **the gate's gradient** needs each key's and each query's sum of dS (``d c_t = rowsum_t -
  colsum_t``, then a reverse scan: :func:`gate_scan.gate_grad`). Taken from the same float32
  tile, the two sums share their rounding, which keeps ``d log f`` as precise as the Triton
  kernels' (without the query sums it is 10x off). A key's sum is a
  thread's row: two shuffles and an atomic add a quad. A query's sum runs across the warp's
  eight row groups; the reduction transposes as it goes (each exchange sends half the columns a
  thread holds and keeps the other half's sums), so ``n/2 + n/4 + n/8`` shuffles leave each lane
  ``n / 8`` whole sums of ``n`` columns (eight at a time: ``QUERY_CHUNK``), and every lane adds
  its own with atomics.
- **ACP** (:func:`acp_blocks`): the kernel's block sparsity lists, for each key tile, the query
  tiles that keep a key of it; a key tile is two ACP blocks, so the hook masks the pruned keys of
  a visited tile, and the backward differentiates the forward's pruned sum exactly.

- **registers.** At D 64 FlashAttention-4's tiles (128 queries x 128 keys) give a consumer thread
  64 scores of S and 64 of dP, and little room is left: with a thread's two keys of ``d`` loaded
  one by one, ptxas serialized every wgmma of the loop ("insufficient register resources") and
  spilled. So ``d`` is stored with each thread's two keys side by side (:func:`permute_keys`), one
  64-bit load, and the key sums' atomics and the bias's load use one pointer a tile; the loop
  then compiles as FlashAttention-4's own does (dense forward+backward at D 64: 1.16-1.17x
  FlashAttention-4's, against 1.31-1.35x with the keys loaded one by one; H200).

Measured on an H200 (bf16, B x T = 32k, 24 heads, T 4k-16k), with lapse's forward,
forward+backward takes 1.12-1.17x FlashAttention-4's (without a gate) at D 128 and 1.15-1.16x at
D 64, against 1.39-1.47x with the Triton backward; with ACP 0.44-0.45x at T 16k (Triton: 0.53-0.55x).

It serves calls in float16 or bfloat16 with ``D`` in 64, 96 or 128, equal query and key lengths
and no packing (grouped-query heads included), on compute capability 9; elsewhere the Triton
kernels run. ``LAPSE_FA4_BWD=0`` in the environment (or ``ENABLED = False``) turns it off,
``LAPSE_FA4_BWD_ACP=0`` for ACP's calls only. Its first call compiles the kernel (tens of seconds;
FlashAttention-4 caches compiles on disk with ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1``). The
gate terms and the block lists are one Triton launch each (fa4_prep.py; the torch versions here
are their references). Its first use replaces ``flash_attn.cute.interface``'s backward class by
the subclass, whose hooks defer to FlashAttention-4's own for every other ``score_mod`` (a path no
test has run yet: with no ``score_mod`` the hooks are not called at all, which a GPU test checks).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
from pathlib import Path

import torch
from torch import Tensor

from ..backend import LN2
from . import fa4_prep
from .common import ACP_BLOCK, Problem

FA4_VERSION = "4.0.0b36"  # the release whose hooks the subclass fills (their signatures are internal)
ENABLED = os.environ.get("LAPSE_FA4_BWD", "1") != "0"
HEAD_DIMS = (64, 96, 128)  # FlashAttention-4's transposed-tile (SdP_swapAB) configurations on Hopper
ACP = os.environ.get("LAPSE_FA4_BWD_ACP", "1") != "0"  # ACP's backward too (its block sparsity)
QUERY_CHUNK = int(os.environ.get("LAPSE_FA4_BWD_CHUNK", "8"))  # query sums reduced so many columns at once


def query_chunk(n_cols: int) -> int:
    """The columns a thread reduces at once for the query sums (all where QUERY_CHUNK is 0 or does
    not divide them)."""
    return QUERY_CHUNK if QUERY_CHUNK > 0 and n_cols % QUERY_CHUNK == 0 else n_cols

log = logging.getLogger(__name__)


def serves(q: Tensor, p: Problem, block_start: Tensor | None) -> bool:
    """Whether :func:`backward` takes this call (else the Triton kernels do)."""
    return ENABLED and (block_start is None or ACP) and fits(q, p)


def fits(q: Tensor, p: Problem) -> bool:
    """Whether FlashAttention-4's Hopper kernels can take this call's shapes here (the forward's
    and the backward's common conditions)."""
    return (q.is_cuda and p.cu_seqlens is None and p.tq == p.tk and p.d in HEAD_DIMS
            and q.dtype in (torch.float16, torch.bfloat16)
            and torch.cuda.get_device_capability(q.device)[0] == 9 and _kernels() is not None)


def column_terms(c_hi: Tensor, c_lo: Tensor, t: int, tile_n: int, tile_m: int) -> tuple[Tensor, Tensor]:
    """``(d, shift)`` from the gate sums ``c = c_hi + c_lo`` (float32 ``[B, H, >= t]``): ``d_j = c_kref
    - c_j`` with ``kref`` the last key of ``j``'s tile of ``tile_n`` (``[B, H, t]`` padded with zeros
    to whole tiles), and ``shift_i = c_i - c_qref`` over query tiles of ``tile_m`` (``[B, H, t]``).
    In float32: two nearby ``hi`` parts subtract exactly (Sterbenz), so both keep ``c``'s precision.
    The reference of ``fa4_prep.column_terms`` (one launch), which the backward runs."""
    dev = c_hi.device
    j = torch.arange(t, device=dev)
    kref = torch.clamp(j // tile_n * tile_n + tile_n - 1, max=t - 1)
    qref = torch.clamp(j // tile_m * tile_m + tile_m - 1, max=t - 1)
    hi, lo = c_hi[..., :t], c_lo[..., :t]
    d = hi.new_zeros(*hi.shape[:-1], -(-t // tile_n) * tile_n)
    d[..., :t] = (hi[..., kref] - hi) + (lo[..., kref] - lo)
    shift = (hi - hi[..., qref]) + (lo - lo[..., qref])
    return d, shift


def permute_keys(d: Tensor) -> Tensor:
    """``d`` (``[..., whole tiles]``) with each thread's two keys side by side: in the backward's
    transposed tiles a thread holds keys ``g`` and ``g + 8`` of a 16-key slab, stored at ``2 g`` and
    ``2 g + 1`` (one 64-bit load). The reference of ``fa4_prep.column_terms(..., permute="keys")``."""
    *lead, t_pad = d.shape
    return d.reshape(*lead, t_pad // 16, 2, 8).transpose(-1, -2).reshape(*lead, t_pad).contiguous()


def first_kept_keys(block_start: Tensor, t: int, tile_m: int) -> Tensor:
    """The first kept key of each query tile of ``tile_m`` (int64 ``[B, H, M]``): the least over its
    64-row ACP blocks' ``block_start`` (past the last block, the last block's), in keys."""
    sub = tile_m // ACP_BLOCK
    m_tiles = -(-t // tile_m)
    bs = block_start.to(torch.int64)
    pad = m_tiles * sub - bs.shape[-1]
    if pad > 0:
        bs = torch.cat([bs, bs[..., -1:].expand(*bs.shape[:-1], pad)], -1)
    return bs[..., : m_tiles * sub].view(*bs.shape[:-1], m_tiles, sub).amin(-1) * ACP_BLOCK


def acp_blocks(block_start: Tensor, t: int, tile_m: int, tile_n: int):
    """The reference of ``fa4_prep.acp_blocks`` (one launch), which the backward runs.
    FlashAttention-4's backward block sparsity for ACP's staircase: for each key tile of
    ``tile_n``, the query tiles of ``tile_m`` it visits (``(count [B, H, N], indices [B, H, N, M])``
    int32, packed left): those that keep a key of the tile (``block_start``, ``[B, H, ceil(t /
    ACP_BLOCK)]`` in ACP blocks, is each 64-row block's first kept key block) and reach it
    causally. A visited tile may still hold pruned keys: the score hook masks them."""
    m_tiles, n_tiles = -(-t // tile_m), -(-t // tile_n)
    first_kept = first_kept_keys(block_start, t, tile_m)  # [B, H, M]
    m = torch.arange(m_tiles, device=block_start.device)
    n = torch.arange(n_tiles, device=block_start.device)
    last_row = torch.clamp(m * tile_m + tile_m - 1, max=t - 1)  # [M]
    visit = (first_kept[..., None, :] <= (n * tile_n + tile_n - 1)[:, None]) & (
        last_row[None, :] >= (n * tile_n)[:, None])  # [B, H, N, M]
    count = visit.sum(-1, dtype=torch.int32)
    order = torch.sort(visit.to(torch.int8), dim=-1, descending=True, stable=True).indices
    return count.contiguous(), order.to(torch.int32).contiguous()


def backward(q, k, v, o, do, lse2, dlse, c_hi, c_lo, p: Problem, poison: bool = False, block_start=None):
    """``(dq, dk, dv, dcc, dcr)`` as :func:`triton_ops.backward_kernels` returns them (the column
    and row sums of dS float32 ``[B, HQ, T]``), through FlashAttention-4's kernel. ``poison``: the
    gradients' buffers start as NaN (tests), so that a part the kernel leaves unwritten shows.
    ``block_start`` (ACP): the kernel visits the kept tiles only (:func:`acp_blocks`) and masks
    the pruned keys of a visited one, so it differentiates the forward's pruned sum exactly."""
    interface, score_mod, score_mod_bwd, score_mod_acp = _kernels()
    t = p.tq
    cfg = interface._tile_size_bwd_sm90(p.d, p.d, True, False)
    tm, tn = cfg.m_block_size, cfg.n_block_size
    sparse, extra = {}, []
    if block_start is not None:
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

        block_start = block_start.to(torch.int32).contiguous()  # the block lists' and the hook's
        count, index = fa4_prep.acp_blocks(block_start, t, tm, tn, ACP_BLOCK)
        sparse = {"block_sparse_tensors": BlockSparseTensorsTorch(count, index, block_size=(tm, tn))}
        extra = [block_start]
        score_mod = score_mod_acp
    d, shift = fa4_prep.column_terms(c_hi, c_lo, t, tn, tm, permute="keys")
    colsum = torch.zeros_like(d)  # atomic adds
    rowsum = d.new_zeros(*d.shape[:-1], -(-t // tm) * tm)
    lse = lse2[..., :t] * LN2 - shift  # the kernel's scores leave out c_i - c_ref
    if dlse is not None:
        dlse = dlse.float().contiguous()
    do = do if do.stride(-1) == 1 else do.contiguous()
    grads = {}
    if poison:
        grads = {n: torch.full_like(x, float("nan")) for n, x in (("dq", q), ("dk", k), ("dv", v))}
    aux = [d, c_hi[..., :t].contiguous(), c_lo[..., :t].contiguous(), colsum, rowsum, *extra]
    dq, dk, dv = interface._flash_attn_bwd(
        q, k, v, o, do, lse.contiguous(), softmax_scale=p.scale, causal=True, score_mod=score_mod,
        score_mod_bwd=score_mod_bwd, dlse=dlse, **grads, **sparse, aux_tensors=aux)[:3]
    return dq, dk, dv, colsum[..., :t].contiguous(), rowsum[..., :t].contiguous()


def built_once(make):
    """``make()`` called once and its result kept, under a lock: one build of a subclass (whose
    markers its hooks compare against) even when threads make their first calls together."""
    lock, cached = threading.Lock(), functools.cache(make)

    @functools.wraps(make)
    def once():
        with lock:
            return cached()

    return once


@built_once
def _kernels():
    """``(interface, score_mod, score_mod_bwd, score_mod_acp)`` (the markers that select the hooks'
    FoX paths), or None where ``flash-attn-4`` ``FA4_VERSION`` and its CuTe DSL do not import (then
    :func:`serves` says no)."""
    try:
        from importlib.metadata import version

        if version("flash-attn-4") != FA4_VERSION:
            log.info("lapse: flash-attn-4 %s is not %s; FoX's backward stays on Triton",
                     version("flash-attn-4"), FA4_VERSION)
            return None
        return _build()
    except Exception as e:  # not installed, or its compiler does not load here
        log.info("lapse: flash-attn-4 not usable (%s: %s); FoX's backward stays on Triton",
                 type(e).__name__, e)
        return None


def _build():
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import interface
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90 as Base
    from flash_attn.cute.utils import atomic_add_fp32
    from quack import layout_utils

    @cute.jit
    def fox_bias(scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):  # selects the hooks below
        return scores

    @cute.jit
    def fox_bias_acp(scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):  # the same, with ACP's mask
        return scores + 0.0

    @cute.jit
    def fox_bias_bwd(grad, scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):  # and their gradient
        return grad

    # FlashAttention-4 keys its compiles (in memory and, with FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED,
    # on disk) by a score_mod's own source, which for these markers never changes: key them by this
    # file's text instead, so that an edited hook is compiled again
    key = Path(__file__).read_bytes() + f"{FA4_VERSION} {QUERY_CHUNK}".encode()
    digest = hashlib.sha256(key).hexdigest()
    for i, marker in enumerate((fox_bias, fox_bias_acp, fox_bias_bwd)):
        getattr(marker, "__wrapped__", marker).__cute_hash__ = f"lapse-fox-{i}-{digest}"
    # the CuTe DSL compiles the methods from their source and looks their free names up here
    globals().update(cutlass=cutlass, cute=cute, layout_utils=layout_utils, atomic_add_fp32=atomic_add_fp32,
                     query_chunk=query_chunk, fox_bias=fox_bias, fox_bias_acp=fox_bias_acp,
                     fox_bias_bwd=fox_bias_bwd, Base=Base)

    class FoxBackwardSm90(Base):
        @cute.jit
        def apply_score_mod(self, acc_S, thr_mma_SdP, batch_idx, head_idx, m_block, n_block, softmax_scale,
                            seqlen_info, aux_data=None, fastdiv_mods=(None, None)):
            if cutlass.const_expr(self.score_mod is not fox_bias and self.score_mod is not fox_bias_acp):
                Base.apply_score_mod(self, acc_S, thr_mma_SdP, batch_idx, head_idx, m_block, n_block,
                                     softmax_scale, seqlen_info, aux_data, fastdiv_mods)
            else:
                assert self.SdP_swapAB
                m_d, m_chi, m_clo = aux_data.tensors[:3]
                last_q = cutlass.min(m_block * self.tile_m + self.tile_m - 1, seqlen_info.seqlen_q - 1)
                last_k = cutlass.min(n_block * self.tile_n + self.tile_n - 1, seqlen_info.seqlen_k - 1)
                tile_bias = ((m_chi[batch_idx, head_idx, last_q] - m_chi[batch_idx, head_idx, last_k])
                             + (m_clo[batch_idx, head_idx, last_q] - m_clo[batch_idx, head_idx, last_k]))
                acc_mn = layout_utils.reshape_acc_to_mn(acc_S)  # rows: keys, columns: queries
                t_mn = layout_utils.reshape_acc_to_mn(thr_mma_SdP.partition_C(
                    cute.make_identity_tensor((self.tile_n, self.tile_m))))
                t0_mn = layout_utils.reshape_acc_to_mn(thr_mma_SdP.get_slice(0).partition_C(
                    cute.make_identity_tensor((self.tile_n, self.tile_m))))
                # this thread's two keys (rows g and g + 8 of a 16-key slab) side by side in d: one load
                assert cute.size(acc_mn.shape[0]) == 2 and t0_mn[1, 0][0] - t0_mn[0, 0][0] == 8
                row0 = t_mn[0, 0][0]
                at = (m_d[batch_idx, head_idx, None].iterator + (n_block * self.tile_n + row0 // 16 * 16
                                                                  + row0 % 16 * 2)).toint()
                g_d = cute.make_ptr(cutlass.Float32, at, cute.AddressSpace.gmem, assumed_align=8)
                g_d = cute.make_tensor(g_d, cute.make_layout(2))
                r_d = cute.make_rmem_tensor(2, cutlass.Float32)
                cute.autovec_copy(g_d, r_d)
                for r in cutlass.range(cute.size(acc_mn.shape[0]), unroll_full=True):
                    bias = tile_bias + r_d[r]
                    for c in cutlass.range(cute.size(acc_mn.shape[1]), unroll_full=True):
                        acc_mn[r, c] = acc_mn[r, c] * softmax_scale + bias
                if cutlass.const_expr(self.score_mod is fox_bias_acp):
                    self._acp_mask(acc_mn, t_mn, thr_mma_SdP, aux_data.tensors[5], batch_idx, head_idx,
                                   m_block, n_block)

        @cute.jit
        def _acp_mask(self, acc_mn, t_mn, thr_mma_SdP, m_start, batch_idx, head_idx, m_block, n_block):
            """ACP's pruned keys in a visited tile: key j of a query in 64-row block b is pruned
            when ``j < 64 * block_start[b]``. Only a tile that starts before some block's first
            kept key has any; a thread's query columns fall in 64-row blocks known statically."""
            # a thread's column c lies in thread 0's column c's 64-row block only when the
            # warpgroups split the keys (AtomLayoutMSdP 1: FlashAttention-4's choice at D 64-128)
            assert self.AtomLayoutMSdP == 1 and self.tile_m % 64 == 0
            sub = self.tile_m // 64
            n_start = m_start.shape[2]
            starts = []
            for s_ in cutlass.range_constexpr(sub):
                blk = cutlass.min(m_block * sub + s_, n_start - 1)
                starts.append(m_start[batch_idx, head_idx, blk] * 64)
            first_key = n_block * self.tile_n
            reach = starts[0]
            for s_ in cutlass.range_constexpr(1, sub):
                reach = cutlass.max(reach, starts[s_])
            if first_key < reach:
                t0_mn = layout_utils.reshape_acc_to_mn(thr_mma_SdP.get_slice(0).partition_C(
                    cute.make_identity_tensor((self.tile_n, self.tile_m))))
                for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
                    key = first_key + t_mn[r, 0][0]
                    for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                        pruned = key < starts[t0_mn[0, c][1] // 64]
                        kept = acc_mn[r, c]
                        acc_mn[r, c] = cutlass.Float32(cutlass.select_(pruned, -cutlass.Float32.inf, kept))

        @cute.jit
        def apply_score_mod_bwd(self, grad_tensor, score_tensor, thr_mma_SdP, batch_idx, head_idx, m_block,
                                n_block, softmax_scale, seqlen_info, aux_data=None,
                                fastdiv_mods=(None, None)):
            if cutlass.const_expr(self.score_mod_bwd is not fox_bias_bwd):
                Base.apply_score_mod_bwd(self, grad_tensor, score_tensor, thr_mma_SdP, batch_idx, head_idx,
                                         m_block, n_block, softmax_scale, seqlen_info, aux_data, fastdiv_mods)
            else:
                # the bias is added, so dS passes unchanged; the key and the query sums of dS
                m_dc, m_dr = aux_data.tensors[3], aux_data.tensors[4]
                g_mn = layout_utils.reshape_acc_to_mn(grad_tensor)
                t_mn = layout_utils.reshape_acc_to_mn(thr_mma_SdP.partition_C(
                    cute.make_identity_tensor((self.tile_n, self.tile_m))))
                lane = cute.arch.lane_idx()
                t0_mn = layout_utils.reshape_acc_to_mn(thr_mma_SdP.get_slice(0).partition_C(
                    cute.make_identity_tensor((self.tile_n, self.tile_m))))
                first = n_block * self.tile_n + t_mn[0, 0][0]
                g_dc = cute.domain_offset((first,), m_dc[batch_idx, head_idx, None])
                totals = []
                for r in cutlass.range_constexpr(cute.size(g_mn.shape[0])):  # a key's: its quad's row
                    total = g_mn[r, 0]
                    for c in cutlass.range_constexpr(1, cute.size(g_mn.shape[1])):
                        total += g_mn[r, c]
                    total += cute.arch.shuffle_sync_bfly(total, offset=1)
                    total += cute.arch.shuffle_sync_bfly(total, offset=2)
                    totals.append(total)
                if lane % 4 == 0:
                    for r in cutlass.range_constexpr(len(totals)):
                        atomic_add_fp32(totals[r], (g_dc.iterator + (t0_mn[r, 0][0] - t0_mn[0, 0][0])))
                self._query_sums(g_mn, t_mn, t0_mn, m_dr, batch_idx, head_idx, m_block, lane)

        @cute.jit
        def _query_sums(self, g_mn, t_mn, t0_mn, m_dr, batch_idx, head_idx, m_block, lane):
            """Each query's sum of dS over the tile's keys (the module's docstring): a thread's keys,
            then the warp's row groups (lane bits 4, 3, 2) by a transposing reduction, QUERY_CHUNK
            columns at a time (fewer sums live at once: the same shuffles, fewer registers)."""
            n_cols = cute.size(g_mn.shape[1])
            chunk = query_chunk(n_cols)
            for c in cutlass.range_constexpr(n_cols):  # a thread's queries: pairs eight apart
                assert t0_mn[0, c][1] == 8 * (c // 2) + c % 2
            for c0 in cutlass.range_constexpr(0, n_cols, chunk):
                self._query_sums_of(g_mn, t_mn, m_dr, batch_idx, head_idx, m_block, lane, c0, chunk)

        @cute.jit
        def _query_sums_of(self, g_mn, t_mn, m_dr, batch_idx, head_idx, m_block, lane, c0, chunk):
            vals = []
            for c in cutlass.range_constexpr(c0, c0 + chunk):
                total = g_mn[0, c]
                for r in cutlass.range_constexpr(1, cute.size(g_mn.shape[0])):
                    total += g_mn[r, c]
                vals.append(total)
            # each exchange keeps the upper half of the columns where the lane's bit is set: the
            # column a lane keeps is c0 + i + the halves' offsets of its set bits
            dup = 0  # lane bits whose lanes end with the same sums (an odd number of columns left)
            kept_at = []  # (lane bit, column offset) of each halving
            for stage in cutlass.range_constexpr(3):
                off = 16 >> stage
                n = len(vals)
                if cutlass.const_expr(n % 2 == 0):
                    upper = (lane & off) != 0
                    kept_vals = []
                    for i in cutlass.range_constexpr(n // 2):
                        keep = cutlass.Float32(cutlass.select_(upper, vals[i + n // 2], vals[i]))
                        send = cutlass.Float32(cutlass.select_(upper, vals[i], vals[i + n // 2]))
                        kept_vals.append(keep + cute.arch.shuffle_sync_bfly(send, offset=off))
                    vals = kept_vals
                    kept_at.append((off, n // 2))
                else:
                    for i in cutlass.range_constexpr(n):
                        vals[i] = vals[i] + cute.arch.shuffle_sync_bfly(vals[i], offset=off)
                    dup |= off
            shift = 0
            for off, half in kept_at:
                shift = shift + cutlass.Int32(cutlass.select_((lane & off) != 0, half, 0))
            if (lane & dup) == 0:
                for i in cutlass.range_constexpr(len(vals)):
                    c = c0 + i + shift  # this lane's column of the thread's tile (dynamic)
                    query = m_block * self.tile_m + t_mn[0, 0][1] + (c // 2) * 8 + c % 2
                    g_dr = cute.domain_offset((query,), m_dr[batch_idx, head_idx, None])
                    atomic_add_fp32(vals[i], g_dr.iterator)

    interface.FlashAttentionBackwardSm90 = FoxBackwardSm90  # the interface builds its kernel from this name
    log.info("lapse: FoX's backward runs on FlashAttention-4 %s (its first call compiles the kernel)",
             FA4_VERSION)
    return interface, fox_bias, fox_bias_bwd, fox_bias_acp
