"""FoX's forward on FlashAttention-4's Hopper kernel, where ``flash-attn-4`` is installed.

``FlashAttentionForwardSm90`` (a producer warp brings K and V by TMA; two consumer warpgroups of
64 query rows at D 128, three at D 64, each overlapping one key tile's softmax with the next
one's products) calls ``apply_score_mod`` on each tile of ``S = Q K^T``. A subclass fills it with
the FoX bias the way the backward's does (fa4_bwd.py):

- a query tile's scores use ``c_ref``, the gate sum at its last row, instead of ``c_i`` (a row's
  constant cancels in its softmax), so the kernel's lse lacks ``c_i - c_ref``, added back here;
- key ``j``'s term is ``(c_ref - c_kref) + d_j``: one number a tile pair plus ``d_j = c_kref -
  c_j`` (``kref`` the key tile's last key), and a score costs one multiply-add;
- a thread holds 32 of a tile's 128 key columns (pairs eight apart), so ``d`` is stored with each
  thread's columns side by side (:func:`permute_columns`) and a thread loads its 32 in eight
  128-bit loads. With one scalar load a column it took 1.25x FlashAttention-4's time at D 128
  (this forward without the loads: 1.10x).

**ACP** (``block_start``): the kernel's block sparsity lists, for each query tile, the key tiles
from its first kept key to the diagonal (:func:`acp_key_tiles`); in a listed tile the hook masks
the keys a thread's 64-row block prunes (a warp's rows lie in one such block). So it computes
exactly the Triton forward's pruned sum, and the backward (either) differentiates it.

**Slower than the Triton forward, so off by default** (H200, bf16, B x T = 32k, 24 heads):
1.31-1.35x FlashAttention-4's forward at D 128 and 1.69-1.81x at D 64 with the column terms loaded
in the hook, 1.35x and 1.45-1.64x with them staged through shared memory (``STAGED``, below),
where Triton's takes 1.18-1.27x and 1.18-1.25x; with ACP forward+backward equal at D 128 and
slower at D 64. The loads' latency is not what costs (staging them did not help at D 128); the
per-column add before the row max, which puts the scores' multiply-adds behind the terms, and
19-28% more instructions on the softmax are what is left.

``STAGED`` (``LAPSE_FA4_FWD_STAGED``, on): each hook call starts a ``cp.async`` (16 bytes a lane)
of the next key tile's terms into its warp's half of two stages in shared memory, which the
kernel's shared storage grows by (``_get_shared_storage_cls``; the instance the trace makes is
kept on the kernel object for the hook), and reads its own tile's from there.

``LAPSE_FA4_FWD=1`` (or ``ENABLED = True``) turns it on, for the calls the backward's kernel can
take (fa4_bwd.fits: float16 or bfloat16, ``D`` 64, 96 or 128, equal query and key lengths, no
packing, compute capability 9); ``LAPSE_FA4_FWD_ACP=0`` keeps ACP's calls on Triton.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch
from torch import Tensor

from ..backend import LN2
from . import fa4_bwd, fa4_prep
from .common import ACP_BLOCK, Problem

ENABLED = os.environ.get("LAPSE_FA4_FWD", "0") == "1"  # off by default: slower than Triton's (docstring)
ACP = os.environ.get("LAPSE_FA4_FWD_ACP", "1") != "0"
HEAD_DIMS = (64, 96, 128)
PREFETCH = int(os.environ.get("LAPSE_FA4_FWD_PREFETCH", "1"))  # key tiles ahead whose column terms go to L1
STAGED = os.environ.get("LAPSE_FA4_FWD_STAGED", "1") == "1"  # the column terms through shared memory

log = logging.getLogger(__name__)


def serves(q: Tensor, p: Problem, block_start: Tensor | None) -> bool:
    """Whether :func:`forward` takes this call (else the Triton kernel does)."""
    return (ENABLED and (block_start is None or ACP) and p.d in HEAD_DIMS and fa4_bwd.fits(q, p)
            and _kernels() is not None)


def tiles(d: int) -> tuple[int, int]:
    """``(tile_m, tile_n)`` of FlashAttention-4's causal Hopper forward at head dim ``d``."""
    from flash_attn.cute import interface

    cfg = interface._tile_size_fwd_sm90(d, d, True, False)
    return cfg.m_block_size, cfg.n_block_size


def permute_columns(d: Tensor, tile_n: int) -> Tensor:
    """``d`` (``[..., whole tiles of tile_n]``) with each thread's columns side by side: in a tile,
    the thread of quad lane ``q`` holds columns ``8 i + 2 q + e`` (``e`` 0 or 1, the wgmma
    accumulator's layout), stored at ``q * tile_n / 4 + 2 i + e``. The reference of
    ``fa4_prep.column_terms(..., permute="columns")``."""
    *lead, t_pad = d.shape
    x = d.reshape(*lead, t_pad // tile_n, tile_n // 8, 4, 2)  # [.., tile, i, q, e]
    return x.transpose(-3, -2).reshape(*lead, t_pad).contiguous()


def acp_key_tiles(block_start: Tensor, t: int, tile_m: int, tile_n: int) -> tuple[Tensor, Tensor]:
    """The reference of ``fa4_prep.acp_key_tiles``. FlashAttention-4's forward block sparsity for
    ACP's staircase: for each query tile of ``tile_m``, the key tiles of ``tile_n`` from the one
    holding its first kept key (the least over its 64-row blocks' ``block_start``) to its diagonal
    (``(count [B, H, M], index [B, H, M, N])`` int32, increasing, packed left, zeros after)."""
    m_tiles, n_tiles = -(-t // tile_m), -(-t // tile_n)
    first = fa4_bwd.first_kept_keys(block_start, t, tile_m) // tile_n
    m = torch.arange(m_tiles, device=block_start.device)
    last = torch.clamp(m * tile_m + tile_m - 1, max=t - 1) // tile_n  # [M]
    count = (last - first + 1).clamp_min(0)
    n = torch.arange(n_tiles, device=block_start.device)
    index = torch.where(n < count[..., None], first[..., None] + n, 0)
    return count.to(torch.int32).contiguous(), index.to(torch.int32).contiguous()


def forward(q, k, v, c_hi, c_lo, p: Problem, block_start=None, poison: bool = False) -> tuple[Tensor, Tensor]:
    """``(o, lse2)`` as :func:`triton_ops.forward_kernel` returns them (the base-2 lse in ``c_hi``'s
    shape), through FlashAttention-4's kernel."""
    interface, fox, fox_acp = _kernels()
    t = p.tq
    tm, tn = tiles(p.d)
    d, shift = fa4_prep.column_terms(c_hi, c_lo, t, tn, tm, permute="columns")
    aux = [d, c_hi, c_lo]
    sparse = {}
    mod = fox
    if block_start is not None:
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

        block_start = block_start.to(torch.int32).contiguous()
        count, index = fa4_prep.acp_key_tiles(block_start, t, tm, tn, ACP_BLOCK)
        none = count.new_zeros(count.shape), count.new_zeros(*count.shape, 1)  # no "full" tiles: all masked
        sparse = {"block_sparse_tensors": BlockSparseTensorsTorch(count, index, *none, block_size=(tm, tn))}
        aux.append(block_start)
        mod = fox_acp
    out = torch.full_like(q, float("nan")) if poison else None
    o, lse = interface._flash_attn_fwd(q, k, v, softmax_scale=p.scale, causal=True, return_lse=True,
                                       score_mod=mod, aux_tensors=aux, pack_gqa=False, out=out, **sparse)[:2]
    lse2 = c_hi.new_empty(c_hi.shape)  # the Triton kernel's shape (past t: never read)
    torch.div(lse + shift, LN2, out=lse2[..., :t])
    return o, lse2


@fa4_bwd.built_once
def _kernels():
    """``(interface, fox, fox_acp)`` (the markers that select the hook's FoX paths), or None where
    FlashAttention-4 is not usable (fa4_bwd._kernels says why)."""
    if fa4_bwd._kernels() is None:
        return None
    try:
        return _build()
    except Exception as e:  # pragma: no cover - a CuTe DSL that does not take the subclass
        log.info("lapse: FoX's forward stays on Triton (%s: %s)", type(e).__name__, e)
        return None


def _build():
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import cpasync
    from flash_attn.cute import interface
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90 as Base
    from quack import layout_utils

    @cute.jit
    def fox(scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):  # selects the hook's FoX path
        return scores

    @cute.jit
    def fox_acp(scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):  # the same, with ACP's mask
        return scores + 0.0

    key = Path(__file__).read_bytes() + f"{fa4_bwd.FA4_VERSION} {PREFETCH} {STAGED}".encode()
    digest = hashlib.sha256(key).hexdigest()
    for i, marker in enumerate((fox, fox_acp)):  # compiles keyed by this file's text (fa4_bwd.py says why)
        getattr(marker, "__wrapped__", marker).__cute_hash__ = f"lapse-fox-fwd-{i}-{digest}"
    globals().update(cutlass=cutlass, cute=cute, layout_utils=layout_utils, fox=fox, fox_acp=fox_acp,
                     Base=Base, PREFETCH=PREFETCH, STAGED=STAGED, cpasync=cpasync)

    class _Recorded(cute.struct):
        """FlashAttention-4's shared storage with room for the column terms; the kernel's instance
        is kept on the kernel object as the trace makes it, for the score hook to find."""

        def __init__(self, cls, owner):
            super().__init__(cls)
            self.owner = owner

        def __call__(self, base, *, loc=None, ip=None):
            made = super().__call__(base, loc=loc, ip=ip)
            self.owner._fox_storage = made
            return made

    class FoxForwardSm90(Base):
        def _get_shared_storage_cls(self):
            base = Base._get_shared_storage_cls(self)
            if not STAGED or (self.score_mod is not fox and self.score_mod is not fox_acp):
                return base
            fields = dict(base._annotations)
            terms = 2 * (self.num_threads // 32) * self.tile_n  # two stages a warp
            fields["fox_d"] = cute.struct.Align[cute.struct.MemRange[cutlass.Float32, terms], 128]
            return _Recorded(type("FoxSharedStorage", (), {"__annotations__": fields}), self)

        @cute.jit
        def apply_score_mod(self, thr_mma_qk, batch_idx, head_idx, m_block, acc_S, n_block, softmax_scale,
                            seqlen, aux_data=None, fastdiv_mods=None):
            if cutlass.const_expr(self.score_mod is not fox and self.score_mod is not fox_acp):
                Base.apply_score_mod(self, thr_mma_qk, batch_idx, head_idx, m_block, acc_S, n_block,
                                     softmax_scale, seqlen, aux_data, fastdiv_mods)
            else:
                m_d, m_chi, m_clo = aux_data.tensors[:3]
                last_q = cutlass.min(m_block * self.tile_m + self.tile_m - 1, seqlen.seqlen_q - 1)
                last_k = cutlass.min(n_block * self.tile_n + self.tile_n - 1, seqlen.seqlen_k - 1)
                tile_bias = ((m_chi[batch_idx, head_idx, last_q] - m_chi[batch_idx, head_idx, last_k])
                             + (m_clo[batch_idx, head_idx, last_q] - m_clo[batch_idx, head_idx, last_k]))
                acc_mn = layout_utils.reshape_acc_to_mn(acc_S)  # rows: queries, columns: keys
                c_s = cute.make_identity_tensor((self.tile_m, self.tile_n))
                t_mn = layout_utils.reshape_acc_to_mn(thr_mma_qk.partition_C(c_s))
                t0_mn = layout_utils.reshape_acc_to_mn(thr_mma_qk.get_slice(0).partition_C(c_s))
                per = self.tile_n // 4  # a thread's columns: 8 i + 2 q + e (permute_columns)
                assert cute.size(acc_mn.shape[1]) == per
                for c in cutlass.range_constexpr(per):
                    assert t0_mn[0, c][1] == 8 * (c // 2) + c % 2
                quad = t_mn[0, 0][1] // 2
                row = m_d[batch_idx, head_idx, None]
                start = (row.iterator + (n_block * self.tile_n + quad * per)).toint()
                g_d = cute.make_tensor(cute.make_ptr(cutlass.Float32, start, cute.AddressSpace.gmem,
                                                     assumed_align=16), cute.make_layout(per))
                r_d = cute.make_rmem_tensor(per, cutlass.Float32)
                if cutlass.const_expr(STAGED):
                    last = 0  # the last key tile the loop visits (it walks down): ACP's first kept
                    if cutlass.const_expr(self.score_mod is fox_acp):
                        last = self._first_kept_tile(aux_data.tensors[3], batch_idx, head_idx, m_block)
                    self._staged_columns(r_d, row, m_block, n_block, last, seqlen, quad, per)
                else:
                    # the tiles PREFETCH ahead into L1 (the loop walks down the keys): this thread's line
                    for ahead in cutlass.range_constexpr(1, PREFETCH + 1):
                        cute.arch.prefetch((g_d.iterator + (-ahead * self.tile_n)).llvm_ptr, cache_level="L1")
                    cute.autovec_copy(g_d, r_d)
                for c in cutlass.range(per, unroll_full=True):
                    bias = tile_bias + r_d[c]
                    for r in cutlass.range(cute.size(acc_mn.shape[0]), unroll_full=True):
                        acc_mn[r, c] = acc_mn[r, c] * softmax_scale + bias
                if cutlass.const_expr(self.score_mod is fox_acp):
                    self._acp_mask(acc_mn, t_mn, aux_data.tensors[3], batch_idx, head_idx, m_block, n_block)

        @cute.jit
        def _first_kept_tile(self, m_start, batch_idx, head_idx, m_block):
            """ACP: the key tile holding query tile ``m_block``'s first kept key, the last one its
            block list visits (``acp_key_tiles``): the least over its 64-row blocks'."""
            sub, top = self.tile_m // 64, m_start.shape[2] - 1
            first = m_start[batch_idx, head_idx, cutlass.min(m_block * sub, top)]
            for s_ in cutlass.range_constexpr(1, sub):
                first = cutlass.min(first, m_start[batch_idx, head_idx, cutlass.min(m_block * sub + s_, top)])
            return first * 64 // self.tile_n

        @cute.jit
        def _staged_columns(self, r_d, row, m_block, n_block, last, seqlen, quad, per):
            """This thread's column terms of key tile ``n_block`` into ``r_d`` from shared memory,
            where the previous tile's call copied them (``cp.async``: each warp its own copy of the
            tile's 128 terms, two stages), after starting the copy of the next tile (``n_block -
            1``: the loop walks down the keys to ``last``). A query tile's first (its diagonal)
            copies its own; its last starts none and waits for every copy, so none is in flight
            when the program moves on or ends."""
            warp = cute.arch.warp_idx()
            lane = cute.arch.lane_idx()
            n_tiles = cute.ceil_div(seqlen.seqlen_k, self.tile_n)
            first = cutlass.min(n_tiles, cute.ceil_div((m_block + 1) * self.tile_m, self.tile_n)) - 1
            stages = cute.make_layout((self.tile_n, self.num_threads // 32, 2))  # (term, warp, stage)
            s_d = self._fox_storage.fox_d.get_tensor(stages)
            cute.arch.sync_warp()  # every lane's reads of the stage about to be refilled are done
            if n_block == first:
                self._copy_columns(row, s_d, n_block, warp, lane)
            if n_block > last:
                self._copy_columns(row, s_d, n_block - 1, warp, lane)
                cute.arch.cp_async_wait_group(1)
            else:
                cute.arch.cp_async_wait_group(0)
            cute.arch.sync_warp()
            mine = cute.domain_offset((quad * per, warp, n_block % 2), s_d)
            cute.autovec_copy(cute.make_tensor(mine.iterator.align(16), cute.make_layout(per)), r_d)

        @cute.jit
        def _copy_columns(self, row, s_d, n, warp, lane):
            """Key tile ``n``'s column terms to this warp's stage ``n % 2``, a 16-byte cp.async a lane."""
            atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                       cutlass.Float32, num_bits_per_copy=128)
            assert self.tile_n == 128  # a lane's 16 bytes: a warp copies the tile's 128 terms at once
            vec = self.tile_n // 32  # floats a lane copies
            at = (row.iterator + (n * self.tile_n + lane * vec)).toint()
            src = cute.make_ptr(cutlass.Float32, at, cute.AddressSpace.gmem, assumed_align=16)
            src = cute.make_tensor(src, cute.make_layout(vec))
            dst = cute.domain_offset((lane * vec, warp, n % 2), s_d)
            cute.copy(atom, src, cute.make_tensor(dst.iterator.align(16), cute.make_layout(vec)))
            cute.arch.cp_async_commit_group()

        @cute.jit
        def _acp_mask(self, acc_mn, t_mn, m_start, batch_idx, head_idx, m_block, n_block):
            """The keys a thread's 64-row block prunes (key ``j < 64 * block_start``): a warp's 16
            rows lie in one such block, so the test is the warp's, once a tile."""
            assert self.tile_m % 64 == 0
            blk = cutlass.min((m_block * self.tile_m + t_mn[0, 0][0]) // 64, m_start.shape[2] - 1)
            first_kept = m_start[batch_idx, head_idx, blk] * 64
            first_key = n_block * self.tile_n
            if first_key < first_kept:
                for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                    pruned = first_key + t_mn[0, c][1] < first_kept
                    for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
                        kept = acc_mn[r, c]
                        acc_mn[r, c] = cutlass.Float32(cutlass.select_(pruned, -cutlass.Float32.inf, kept))

    interface.FlashAttentionForwardSm90 = FoxForwardSm90  # the interface builds its kernel from this name
    log.info("lapse: FoX's forward runs on FlashAttention-4 %s (its first call compiles the kernel)",
             fa4_bwd.FA4_VERSION)
    return interface, fox, fox_acp
