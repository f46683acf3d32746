"""ACP's forward as one flat loop over every kept key tile of a program's query tiles (issue 16).

The table's ACP forward runs one program per query tile. A local head's tile keeps 1 to 14
key tiles, and each program's fixed start (its Q and first key loads) and end (the O
store) is most of its time (BENCHMARKS.md, twenty-first to twenty-sixth sessions). Here a
few programs a multiprocessor each take a run of query tiles ("items") of equal total work
and walk all their kept key tiles in *one* software-pipelined loop, so the loads of the next
item's first tiles are in flight during this item's last tile and its O store: the overlap a
loop of tiles with inner loops does not give (the twenty-third session's ``PERSISTENT``).

The loop's addresses must not hang on a value loaded in the loop before (the pipeliner
could not run ahead), so a schedule made before the launch lists every step of the flat
space: :func:`schedule` gives, per step, its batch row, head, query tile, key tile and
whether it is its item's last in one 64-bit word, and per program the first step and the
step count. Each step's word is loaded a step ahead. A step reloads its item's Q tile and row
bias (cache hits after the item's first step); the item's last step writes O and the lse
and resets the softmax state.

Scope: ACP (``block_start``), ``T_q <= T_k``, no packed sequences, D up to 128, query and key tiles of
one ACP block (64). Every step masks causally (the diagonal tile, and with ``T_q < T_k``
the one or two tiles it straddles), so there is no separate diagonal loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import LOG2E, LOG2E_TL
from .common import ACP_BLOCK
from .triton_fwd import head_rows_descriptor, key_bias

# a step's word: batch row << 47 | query head << 39 | query tile << 20 | key tile << 1 | last,
# so that a step decodes with shifts and masks (no divisions by run-time sizes)
TILE_BITS = 19  # query and key tiles below 2^19 (sequences below 2^25 tokens)
HEAD_BITS = 8  # query heads below 256
BATCH_BITS = 16  # batch rows below 65536
PROGRAMS = 4  # programs a multiprocessor (the table's ACP forward at D 64 fits four)
_KT_SHIFT = tl.constexpr(1)
_M_SHIFT = tl.constexpr(1 + TILE_BITS)
_H_SHIFT = tl.constexpr(1 + 2 * TILE_BITS)
_B_SHIFT = tl.constexpr(1 + 2 * TILE_BITS + HEAD_BITS)
_TILE_MASK = tl.constexpr((1 << TILE_BITS) - 1)
_HEAD_MASK = tl.constexpr((1 << HEAD_BITS) - 1)


@triton.jit
def _item_tiles(i_m, BS, i_bh, MB, TQ, TK, BM: tl.constexpr, BN: tl.constexpr):
    """Query tile ``i_m``'s key tiles: the first kept, the first that needs the causal mask (a
    key after its first query) and one past the last it sees."""
    first_abs = i_m * BM + TK - TQ
    kt0 = tl.load(BS + i_bh * MB + i_m).to(tl.int64)
    return kt0, (first_abs + 1) // BN, (tl.minimum(i_m * BM + BM, TQ) - 1 + TK - TQ) // BN + 1


@triton.jit
def _first_masked(i_m, kt0, kt1, TQ, TK, G: tl.constexpr):
    """Query tile ``i_m``'s first key tile that needs the causal mask (a key after its first
    query), and at least its last one: the steps that set each row's maximum."""
    return tl.minimum(tl.maximum((i_m * G + TK - TQ + 1) // G, kt0), kt1 - 1)


@triton.jit
def _redo_item(Q, K, V, CHI, CPAIRS, O, LSE, BS, i_b, i_h, i_m,
               stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
               stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh,
               qk_scale, TQ, TK, TC, HQ, MB,
               GROUP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               DOT_PREC: tl.constexpr):
    """An item whose weights overflowed the diagonal's reference (a logit ~127 above it, base 2)
    done again the usual way: every kept key tile with the online maximum, pointer loads."""
    i_bh = i_b * HQ + i_h
    i_hk = i_h // GROUP
    off = TK - TQ
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < TQ
    o_abs = o_m + off
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    p_c = CHI + i_bh * TC
    c_ref = tl.load(p_c + i_m * BM + off)
    o_absc = tl.minimum(o_abs, TK - 1)
    b_cq = ((tl.load(p_c + o_absc) - c_ref) + tl.load(CPAIRS + (i_bh * TC + o_absc) * 2 + 1)) * LOG2E_TL
    b_q = tl.load(Q + i_b * stride_qb + o_m[:, None] * stride_qt + i_h * stride_qh + o_d[None, :],
                  mask=m_m[:, None] & m_d[None, :], other=0.0)
    kt0, _, kt1 = _item_tiles(i_m, BS, i_bh, MB, TQ, TK, BM, BN)
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    for kt in range(kt0, kt1):
        o_n = kt * BN + tl.arange(0, BN)
        m_n = o_n < TK
        b_k = tl.load(K + i_b * stride_kb + o_n[:, None] * stride_kt + i_hk * stride_kh + o_d[None, :],
                      mask=m_n[:, None] & m_d[None, :], other=0.0)
        b_v = tl.load(V + i_b * stride_vb + o_n[:, None] * stride_vt + i_hk * stride_vh + o_d[None, :],
                      mask=m_n[:, None] & m_d[None, :], other=0.0)
        b_ck = key_bias(p_c, CPAIRS + i_bh * TC * 2, o_n, m_n, c_ref, True)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC) * qk_scale
        b_s = tl.where(o_n[None, :] <= o_abs[:, None], b_s + (b_cq[:, None] - b_ck[None, :]), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(b_s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        b_p = tl.math.exp2(b_s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(b_p, 1)
        acc = tl.dot(b_p.to(b_v.dtype), b_v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new
    l_safe = tl.where(m_m, l_i, 1.0)
    p_o = O + i_b * stride_ob + o_m[:, None] * stride_ot + i_h * stride_oh + o_d[None, :]
    tl.store(p_o, (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])
    tl.store(LSE + i_bh * TC + o_m, m_i + tl.math.log2(l_safe), mask=m_m)


@triton.jit
def _flat_fwd_kernel(
    Q, K, V, QP, KP, VP, CHI, CPAIRS, O, LSE, BS, STEPS, PROG, REDO,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    qk_scale, TQ, TK, TC, HQ, MB,
    GROUP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr, ROW_BIAS: tl.constexpr, STAGES: tl.constexpr,
):
    # Q, K, V: descriptors with USE_TMA (else the pointers QP, KP, VP, which the redo reads)
    pid = tl.program_id(0)
    first = tl.load(PROG + 2 * pid)
    n_steps = tl.load(PROG + 2 * pid + 1)
    off = TK - TQ
    o_r = tl.arange(0, BM)
    o_c = tl.arange(0, BN)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    nxt = tl.load(STEPS + first, mask=n_steps > 0, other=0)
    n_redo = pid * 0
    item0 = ((nxt >> _B_SHIFT) * HQ + ((nxt >> _H_SHIFT) & _HEAD_MASK)) * MB \
        + ((nxt >> _M_SHIFT) & _TILE_MASK)  # the program's first item: its redo list starts there
    for s in tl.range(0, n_steps, num_stages=STAGES):
        # the step's word was loaded a step ahead: its addresses wait on no load of this step
        word = nxt
        nxt = tl.load(STEPS + first + s + 1, mask=s + 1 < n_steps, other=0)
        last = (word & 1) == 1
        kt = (word >> _KT_SHIFT) & _TILE_MASK
        i_m = (word >> _M_SHIFT) & _TILE_MASK
        i_h = (word >> _H_SHIFT) & _HEAD_MASK
        i_b = word >> _B_SHIFT
        i_bh = i_b * HQ + i_h
        i_hk = i_h // GROUP
        o_m = i_m * BM + o_r
        m_m = o_m < TQ
        o_abs = o_m + off
        p_c = CHI + i_bh * TC
        c_ref = tl.load(p_c + i_m * BM + off)
        o_absc = tl.minimum(o_abs, TK - 1)
        b_cq = ((tl.load(p_c + o_absc) - c_ref) + tl.load(CPAIRS + (i_bh * TC + o_absc) * 2 + 1)) * LOG2E_TL
        o_n = kt * BN + o_c
        m_n = o_n < TK
        if USE_TMA:  # descriptors over [B * T, H * D]: rows past a sequence are the next one's (masked)
            b_q = Q.load([(i_b * TQ + i_m * BM).to(tl.int32), (i_h * D).to(tl.int32)])
            b_k = K.load([(i_b * TK + kt * BN).to(tl.int32), (i_hk * D).to(tl.int32)])
            b_v = V.load([(i_b * TK + kt * BN).to(tl.int32), (i_hk * D).to(tl.int32)])
        else:
            b_q = tl.load(QP + i_b * stride_qb + o_m[:, None] * stride_qt + i_h * stride_qh + o_d[None, :],
                          mask=m_m[:, None] & m_d[None, :], other=0.0)
            b_k = tl.load(KP + i_b * stride_kb + o_n[:, None] * stride_kt + i_hk * stride_kh + o_d[None, :],
                          mask=m_n[:, None] & m_d[None, :], other=0.0)
            b_v = tl.load(VP + i_b * stride_vb + o_n[:, None] * stride_vt + i_hk * stride_vh + o_d[None, :],
                          mask=m_n[:, None] & m_d[None, :], other=0.0)
        b_ck = key_bias(p_c, CPAIRS + i_bh * TC * 2, o_n, m_n, c_ref, True)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC) * qk_scale
        if ROW_BIAS:  # the query's own c_i left out (the lse adds it back)
            b_s = b_s - b_ck[None, :]
        else:
            b_s = b_s + (b_cq[:, None] - b_ck[None, :])
        # an item's steps take the key tiles that need the causal mask first, with the online
        # maximum; their maximum (each row has its own key, bias 0) is then the reference of
        # every other tile: no row maximum and no rescaling there (the table's FIXED_MAX)
        kt1 = (tl.minimum(i_m * BM + BM, TQ) - 1 + off) // BN + 1
        if kt >= _first_masked(i_m, 0, kt1, TQ, TK, BN):
            b_s = tl.where(o_n.to(tl.int32)[None, :] <= o_abs.to(tl.int32)[:, None], b_s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(b_s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no kept key yet: exp2 gives 0, not NaN
            b_p = tl.math.exp2(b_s - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(b_p, 1)
            acc = acc * alpha[:, None]
            m_i = m_new
        else:
            b_p = tl.math.exp2(b_s - tl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
            l_i += tl.sum(b_p, 1)
        acc = tl.dot(b_p.to(b_v.dtype), b_v, acc, input_precision=DOT_PREC)
        if last:  # the item's O and lse (every valid row has its own key: l > 0 there)
            finite = (l_i < float("inf")) & (tl.max(tl.abs(acc), 1) < float("inf"))  # NaN: False
            if tl.max(tl.where(m_m & ~finite, 1, 0), 0) > 0:  # a tile overflowed the reference
                tl.store(REDO + item0 + n_redo, (i_bh * MB + i_m).to(tl.int32))
                n_redo += 1
            else:
                l_safe = tl.where(m_m, l_i, 1.0)
                p_o = O + i_b * stride_ob + o_m[:, None] * stride_ot + i_h * stride_oh + o_d[None, :]
                tl.store(p_o, (acc / l_safe[:, None]).to(O.dtype.element_ty),
                         mask=m_m[:, None] & m_d[None, :])
                b_lse = m_i + tl.math.log2(l_safe)
                if ROW_BIAS:
                    b_lse += b_cq
                tl.store(LSE + i_bh * TC + o_m, b_lse, mask=m_m)
        acc = tl.where(last, 0.0, acc)
        l_i = tl.where(last, 0.0, l_i)
        m_i = tl.where(last, float("-inf"), m_i)
    for j in range(0, n_redo):  # after the pipelined loop, so that it stays the innermost
        item = tl.load(REDO + item0 + j).to(tl.int64)
        i_bh = item // MB
        _redo_item(QP, KP, VP, CHI, CPAIRS, O, LSE, BS, i_bh // HQ, i_bh % HQ, item % MB,
                   stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                   stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh,
                   qk_scale, TQ, TK, TC, HQ, MB, GROUP, D, BD, BM, BN, DOT_PREC)


@triton.jit
def _steps_kernel(BS, START, COUNT, STEPS, TQ, TK, HQ, MB, G: tl.constexpr, BLOCK: tl.constexpr):
    # per item (query tile of a (sequence, head)): its steps' words, up to its last key tile
    item = tl.program_id(0).to(tl.int64)
    i_m = item % MB
    i_bh = item // MB
    kt1 = (tl.minimum(i_m * G + G, TQ) - 1 + TK - TQ) // G + 1  # past the last key tile it sees
    kt0 = kt1 - tl.load(COUNT + item)
    base = tl.load(START + item)
    head = ((i_bh // HQ) << _B_SHIFT) | ((i_bh % HQ) << _H_SHIFT) | (i_m << _M_SHIFT)
    # the tiles that need the causal mask first (from kt_mask on), then the others in order
    kt_mask = _first_masked(i_m, kt0, kt1, TQ, TK, G)
    n_mask = kt1 - kt_mask
    for k0 in range(0, kt1 - kt0, BLOCK):
        o_k = k0 + tl.arange(0, BLOCK)
        kt = tl.where(o_k < n_mask, kt_mask + o_k, kt0 + o_k - n_mask)
        word = head | (kt << _KT_SHIFT) | (o_k == kt1 - kt0 - 1).to(tl.int64)
        tl.store(STEPS + base + o_k, word, mask=o_k < kt1 - kt0)


def steps_per_item(block_start: torch.Tensor, tq: int, tk: int) -> torch.Tensor:
    """Kept key tiles of every item (query tile of a (sequence, head), in ``block_start``'s
    order), ``[B * HQ * M]`` int64."""
    m = torch.arange(block_start.shape[-1], device=block_start.device)
    end = (torch.clamp(m * ACP_BLOCK + ACP_BLOCK, max=tq) - 1 + tk - tq) // ACP_BLOCK + 1
    return (end - block_start).reshape(-1).to(torch.int64)


def schedule(block_start: torch.Tensor, tq: int, tk: int, programs: int,
             skip_full: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(steps, prog)``: every step's word (``[items' total steps]`` int64; the first of a
    dense count's upper bound) and per program ``(first step, steps)`` ``[programs, 2]``
    int64. Program ``p`` takes the items whose first step falls in ``[p S / P, (p + 1) S / P)``
    of the ``S`` steps: runs of consecutive items of equal work, to one item. ``skip_full``:
    no steps for the (sequence, head)s that ACP prunes nowhere (``ROUTE``'s second launch)."""
    counts = steps_per_item(block_start, tq, tk)
    if skip_full:  # their last query tile keeps every key (the staircase never steps down)
        full = block_start[..., (tq - 1) // ACP_BLOCK] == 0
        counts = torch.where(full.reshape(-1).repeat_interleave(block_start.shape[-1]), 0, counts)
    n_items = counts.numel()
    start = torch.zeros(n_items + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(counts, 0, out=start[1:])
    dense = block_start.shape[0] * block_start.shape[1] * int(
        ((torch.clamp(torch.arange(block_start.shape[-1]) * ACP_BLOCK + ACP_BLOCK, max=tq) - 1 + tk - tq)
         // ACP_BLOCK + 1).sum())
    steps = torch.empty(max(dense, 1), dtype=torch.int64, device=counts.device)
    _steps_kernel[(n_items,)](block_start, start, counts, steps, tq, tk, block_start.shape[1],
                              block_start.shape[-1], G=ACP_BLOCK, BLOCK=64)
    targets = torch.arange(programs + 1, device=counts.device, dtype=torch.int64) * start[-1] // programs
    bounds = torch.searchsorted(start, targets)  # first item of each program (items start strictly up)
    first = start[bounds]
    prog = torch.stack((first[:-1], first[1:] - first[:-1]), 1).contiguous()
    return steps, prog


def supported(q, block_start, cu, p) -> bool:
    """Whether the flat kernel serves: ACP, no packed sequences, ``T_q <= T_k``, D up to 128
    (its 64 x 64 tiles)."""
    return (block_start is not None and cu is None and p.tq <= p.tk and p.d <= 128
            and p.tk < (1 << TILE_BITS) * ACP_BLOCK and p.hq < (1 << HEAD_BITS)
            and p.batch < (1 << BATCH_BITS))


def programs(q, per_multiprocessor: int) -> int:
    """The launch's programs: ``per_multiprocessor`` on each of the GPU's multiprocessors (on
    the CPU interpreter, as if it had 3, so that the tests split the work)."""
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 3
    return sms * per_multiprocessor


def launch(q, k, v, c_hi, pairs, block_start, p, o, lse2, config: dict, use_tma: int,
           programs: int, skip_full: bool = False) -> None:
    """Runs the flat kernel over ``programs`` programs (:func:`supported` inputs). ``pairs``:
    ``(c_hi, c_lo)`` stacked on a last axis; ``use_tma`` 2: descriptors made on the host;
    ``skip_full``: only the (sequence, head)s that ACP prunes somewhere."""
    cfg = dict(config)
    steps, prog = schedule(block_start, p.tq, p.tk, programs, skip_full)
    bd = max(16, triton.next_power_of_2(p.d))
    qa, ka, va = q, k, v
    if use_tma == 2:
        qa = head_rows_descriptor(q, ACP_BLOCK, bd)
        ka, va = head_rows_descriptor(k, ACP_BLOCK, bd), head_rows_descriptor(v, ACP_BLOCK, bd)
    redo = torch.empty(max(block_start.numel(), 1), dtype=torch.int32, device=q.device)
    _flat_fwd_kernel[(programs,)](
        qa, ka, va, q, k, v, c_hi, pairs, o, lse2, block_start, steps, prog, redo,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        p.scale * LOG2E, p.tq, p.tk, c_hi.shape[-1], p.hq, block_start.shape[-1], GROUP=p.hq // p.h,
        D=p.d, BD=bd, BM=ACP_BLOCK, BN=ACP_BLOCK, DOT_PREC="ieee" if q.dtype.itemsize == 4 else "tf32",
        USE_TMA=use_tma == 2, ROW_BIAS=cfg.pop("ROW_BIAS", False) and q.element_size() < 4,
        STAGES=cfg.pop("num_stages", 2), **cfg,
    )
