"""CASTLE decoding over a paged, per-kv-head UQ-KV store: one new token per sequence.

SPEC section 5 (UQ-KV decoding) over the store of ``lapse.kv.paged``: every (sequence,
kv head) has its own page table and length, because eviction keeps a different number of
tokens per head; logical slot ``i`` of (b, h) is page ``page_table[b, h, i // PS]`` at
offset ``i % PS``. Each slot holds ``k^C, v^C`` of its kv head and, for each of the ``G``
query heads of the group, the lookahead vector ``u`` and query ``q^U`` (``[P, PS, G, D]``
pools, as FoX's ``c`` is ``[P, PS, G]``), and its absolute position (``pos``). Under
eviction a slot's index is not its position: the SWL window is taken over ``pos``.

The step is :func:`lapse.ops.castle.castle_decode_step`'s over the held slots only: the
lookahead update of every held ``u_j`` (in place, in its page), ``u_t = 0``, then the
attention. Slots that eviction dropped take no further updates; the ones kept go on
accumulating exactly as in a dense cache.

The file reads: the plain reference (``naive``), the gathered torch path (``torch``, what
CPUs run), the checks, the public function. The Triton path (one split-K kernel that
updates and attends in a single pass over the pages) is in ``paged_triton.py``; ``auto``
runs it on CUDA and the torch path elsewhere.

Legend: B batch, H kv heads, HQ query heads, G = HQ // H, HU lookahead kv heads, D head
dim, P pages in the pool, PS page size, MP pages per head in the table, L = MP * PS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..backend import BACKENDS, check_backend, resolve_backend
from ..forgetting.common import _shape, check_devices, check_float_dtype, check_tensors, resolve_scale
from ..forgetting.decode_triton import MAX_SPLITS
from ..forgetting.paged import MIN_PAGE_SIZE
from .common import check_window
from .paged_triton import triton_castle_paged_decode

PAGED_BACKENDS = BACKENDS


def _per_query_head(x: Tensor, hq: int) -> Tensor:
    """``[B, HU, D]`` -> ``[B, HQ, D]``: query head ``hq`` reads lookahead head ``hq // (HQ / HU)``."""
    return x.repeat_interleave(hq // x.shape[1], dim=1)


def _paged_step_naive(q_c, k_u, v_u, k_pages, v_pages, u_pages, qu_pages, pos_pages, page_table,
                      lengths, scale, window, return_key_probs):
    """The plain reference: one (sequence, kv head) at a time, its held slots gathered in
    logical order through the table, updated and written back by index, then attended.

    Float32 arithmetic (float64 for a float64 ``u`` in the update, for float64 ``q_c`` in
    the attention), as :func:`castle_decode_step`'s torch path; only held slots are read.
    """
    b, hq, d = q_c.shape
    _, h, max_pages = page_table.shape
    ps = k_pages.shape[1]
    g = hq // h
    acc_u = torch.float64 if u_pages.dtype == torch.float64 else torch.float32
    acc = torch.float64 if q_c.dtype == torch.float64 else torch.float32
    ku, vu = _per_query_head(k_u, hq).to(acc_u), _per_query_head(v_u, hq).to(acc_u)  # [B, HQ, D]
    o = torch.zeros(b, hq, d, dtype=acc, device=q_c.device)
    key_probs = torch.zeros(b, h, max_pages * ps, dtype=torch.float32, device=q_c.device)
    for i in range(b):
        for j in range(h):
            n = int(lengths[i, j])
            heads = slice(j * g, (j + 1) * g)
            slots = torch.arange(n, device=q_c.device)  # [n] logical order
            pages, offs = page_table[i, j].long()[slots // ps], slots % ps  # [n]
            u = u_pages[pages, offs].to(acc_u)  # [n, G, D]
            qu = qu_pages[pages, offs].to(acc_u)  # [n, G, D]
            w = torch.sigmoid(torch.einsum("ngd,gd->ng", qu, ku[i, heads]) * scale)  # [n, G]
            upd = slots < n - 1  # every held slot but the new token's own
            if window is not None:
                pos = pos_pages[pages, offs].long()  # [n] absolute positions
                upd = upd & (pos >= pos[n - 1] - window)
            u = torch.where(upd[:, None, None], u + w[..., None] * vu[i, heads], u)
            u[n - 1] = 0.0
            u = u.to(u_pages.dtype)
            u_pages[pages, offs] = u
            q = q_c[i, heads].to(acc)  # [G, D]
            s_c = torch.einsum("gd,nd->gn", q, k_pages[pages, offs].to(acc)) * scale
            s_u = torch.einsum("gd,ngd->gn", q, u.to(acc)) * scale
            p = torch.softmax(s_c - F.silu(s_u), dim=-1)  # [G, n]
            o[i, heads] = p @ v_pages[pages, offs].to(acc)
            key_probs[i, j, :n] = p.sum(0).float()
    return o.to(q_c.dtype), (key_probs if return_key_probs else None)


def _paged_step_torch(q_c, k_u, v_u, k_pages, v_pages, u_pages, qu_pages, pos_pages, page_table,
                      lengths, scale, window, return_key_probs):
    """The reference's math vectorised over every (sequence, kv head), for CPUs and
    compiled steps: the pages up to the longest head's are gathered at once (on the CPU,
    outside compiled code; elsewhere the whole table, so no host sync and fixed shapes).

    The update goes back into the pool with one ``index_add_`` of the increments (0 on
    every slot not updated): table entries past a head's pages are replaced by page 0
    before the gather, so a pool row may appear twice, but only one of them adds
    anything, and adding the increment is the dense step's ``u + w v`` bit for bit.
    """
    b, hq, d = q_c.shape
    _, h, max_pages = page_table.shape
    ps = k_pages.shape[1]
    g = hq // h
    acc_u = torch.float64 if u_pages.dtype == torch.float64 else torch.float32
    acc = torch.float64 if q_c.dtype == torch.float64 else torch.float32
    n = lengths.long()  # [B, H]
    n_pages = (n + ps - 1) // ps  # [B, H]
    # on the CPU, outside compiled code, data-dependent sizes cost no sync
    host = q_c.device.type == "cpu" and not torch.compiler.is_compiling()
    mp = min(max_pages, max(1, int(n_pages.max()))) if host else max_pages
    n_slots = mp * ps
    used = torch.arange(mp, device=q_c.device) < n_pages[..., None]  # [B, H, mp]
    pages = torch.where(used, page_table[..., :mp], 0).long()  # [B, H, mp]
    flat = pages.flatten()  # [B * H * mp]
    rows = (pages[..., None] * ps + torch.arange(ps, device=q_c.device)).flatten()  # [B * H * L']
    slot = torch.arange(n_slots, device=q_c.device)  # [L']
    last = (n - 1)[..., None]  # [B, H, 1] the new token's slot

    # the lookahead update of every held slot before the new token's
    qu = qu_pages.index_select(0, flat).view(b, h, n_slots, g, d).to(acc_u)  # [B, H, L', G, D]
    u = u_pages.index_select(0, flat).view(b, h, n_slots, g, d)  # [B, H, L', G, D]
    ku = _per_query_head(k_u, hq).view(b, h, g, d).to(acc_u)  # [B, H, G, D]
    vu = _per_query_head(v_u, hq).view(b, h, g, d).to(acc_u)  # [B, H, G, D]
    w = torch.sigmoid(torch.einsum("bhlgd,bhgd->bhlg", qu, ku) * scale)  # [B, H, L', G]
    upd = slot < last  # [B, H, L']
    if window is not None:
        pos = pos_pages.index_select(0, flat).view(b, h, n_slots).long()  # [B, H, L']
        upd = upd & (pos >= pos.gather(2, last) - window)
    inc = torch.where(upd[..., None], w, 0.0)[..., None] * vu[:, :, None]  # [B, H, L', G, D]
    inc = inc.to(u_pages.dtype)
    pool = u_pages.view(-1, g, d)  # [P * PS, G, D]
    pool.index_add_(0, rows, inc.reshape(-1, g, d))
    new_rows = (page_table.long().gather(2, last // ps) * ps + last % ps).flatten()  # [B * H]
    pool.index_fill_(0, new_rows, 0.0)  # u_t = 0
    u = torch.where((slot == last)[..., None, None], 0.0, u + inc)  # what the pool now holds

    # the attention over the held slots, with the updated u
    past = slot >= n[..., None]  # [B, H, L']
    k = k_pages.index_select(0, flat).view(b, h, n_slots, d).to(acc)  # [B, H, L', D]
    v = v_pages.index_select(0, flat).view(b, h, n_slots, d).masked_fill(past[..., None], 0).to(acc)
    q = q_c.view(b, h, g, d).to(acc)  # [B, H, G, D]
    s_c = torch.matmul(q, k.transpose(2, 3)) * scale  # [B, H, G, L']
    s_u = torch.einsum("bhgd,bhlgd->bhgl", q, u.to(acc)) * scale  # [B, H, G, L']
    logits = (s_c - F.silu(s_u)).masked_fill(past[:, :, None, :], float("-inf"))
    p = torch.softmax(logits, dim=-1)  # [B, H, G, L']
    o = torch.matmul(p, v).reshape(b, hq, d)  # [B, HQ, D]
    key_probs = None
    if return_key_probs:
        key_probs = p.sum(dim=2).float()  # [B, H, L']
        if mp < max_pages:
            key_probs = F.pad(key_probs, (0, (max_pages - mp) * ps))
    return o.to(q_c.dtype), key_probs


def _validate(q_c, k_u, v_u, k_pages, v_pages, u_pages, qu_pages, pos_pages, page_table, lengths,
              scale, window, num_splits, check_values, backend) -> tuple[float, int | None, str]:
    """Checks every argument (values only with ``check_values``); returns the scale, the
    window and the backend to run (``auto`` resolved)."""
    tensors = dict(q_c=q_c, k_u=k_u, v_u=v_u, k_pages=k_pages, v_pages=v_pages, u_pages=u_pages,
                   qu_pages=qu_pages, page_table=page_table, lengths=lengths)
    window = check_window(window)
    if window is not None:
        if pos_pages is None:
            raise ValueError("CASTLE-SWL (a window) needs pos_pages, the slots' absolute positions")
        tensors["pos_pages"] = pos_pages
    check_tensors(**tensors)
    check_devices(q_c, **{n: x for n, x in tensors.items() if n != "q_c"})
    check_backend(backend, PAGED_BACKENDS)
    if q_c.dim() != 3:
        raise ValueError(f"q_c must be [batch, query_heads, head_dim], got {_shape(q_c)}")
    b, hq, d = q_c.shape
    if k_u.dim() != 3 or k_u.shape != v_u.shape or k_u.shape[0] != b or k_u.shape[2] != d:
        raise ValueError(f"k_u and v_u must be [batch={b}, lookahead_heads, head_dim={d}] of one shape, "
                         f"got {_shape(k_u)} and {_shape(v_u)}")
    if k_u.shape[1] < 1 or hq % k_u.shape[1]:
        raise ValueError(f"k_u has {k_u.shape[1]} heads, which must divide the {hq} query heads")
    for name, x in (("q_c", q_c), ("k_u", k_u), ("v_u", v_u), ("k_pages", k_pages), ("qu_pages", qu_pages)):
        check_float_dtype(name, x)
    if k_pages.dim() != 3 or k_pages.shape != v_pages.shape or k_pages.shape[2] != d:
        raise ValueError(f"k_pages and v_pages must be [pages, page_size, head_dim={d}] of one shape, got "
                         f"{_shape(k_pages)} and {_shape(v_pages)}")
    if k_pages.dtype != v_pages.dtype:
        raise TypeError(f"k_pages and v_pages must share a dtype, got {k_pages.dtype} and {v_pages.dtype}")
    n_pages, ps, _ = k_pages.shape
    if n_pages < 1 or ps < MIN_PAGE_SIZE or ps & (ps - 1):
        raise ValueError(f"k_pages must hold at least one page of a power of two >= {MIN_PAGE_SIZE} "
                         f"slots, got {_shape(k_pages)}")
    if page_table.dtype != torch.int32 or page_table.dim() != 3 or page_table.shape[0] != b:
        raise ValueError(f"page_table must be int32 [batch={b}, kv_heads, max_pages], "
                         f"got {_shape(page_table)}")
    h, max_pages = page_table.shape[1:]
    if h < 1 or max_pages < 1 or hq % h:
        raise ValueError(f"page_table {_shape(page_table)}: kv heads must divide the {hq} query heads, "
                         "and each head needs at least one page entry")
    if lengths.dtype != torch.int32 or tuple(lengths.shape) != (b, h):
        raise ValueError(f"lengths must be int32 [batch, kv_heads] = {(b, h)}, got {_shape(lengths)}")
    group = (n_pages, ps, hq // h, d)
    for name, x in (("u_pages", u_pages), ("qu_pages", qu_pages)):
        if tuple(x.shape) != group:
            raise ValueError(f"{name} must be [pages, page_size, query_heads // kv_heads, head_dim] = "
                             f"{group}, got {_shape(x)}")
    if u_pages.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"u_pages must be float32 or float64 (a running sum), got {u_pages.dtype}")
    if not u_pages.is_contiguous():
        raise ValueError("u_pages must be contiguous (it is updated in place through a flat view)")
    if pos_pages is not None and (pos_pages.dtype != torch.int32 or tuple(pos_pages.shape) != (n_pages, ps)):
        raise ValueError(f"pos_pages must be int32 [pages, page_size] = {(n_pages, ps)}, "
                         f"got {_shape(pos_pages)}")
    backend = resolve_backend(backend, q_c, PAGED_BACKENDS, products=False)
    if backend == "triton":
        _validate_triton(k_u, k_pages, u_pages, qu_pages, d, num_splits)
    if check_values:
        n_slots = max_pages * ps
        if bool(((lengths < 1) | (lengths > n_slots)).any()):
            raise ValueError(f"lengths must be in [1, max_pages * page_size = {n_slots}], got "
                             f"{lengths.flatten().tolist()[:16]}")
        used = torch.arange(max_pages, device=lengths.device) < ((lengths.long() + ps - 1) // ps)[..., None]
        if bool((used & ((page_table < 0) | (page_table >= n_pages))).any()):
            raise ValueError(f"page_table must hold page ids in [0, pages = {n_pages}) for the pages in use")
    return resolve_scale(scale, d), window, backend


def _validate_triton(k_u, k_pages, u_pages, qu_pages, d, num_splits) -> None:
    """What the kernel adds to the checks: 16- or 32-bit inputs, a float32 ``u``,
    ``D <= 256``, a valid ``num_splits``."""
    for name, x in (("k_u", k_u), ("k_pages", k_pages), ("qu_pages", qu_pages)):
        if x.dtype == torch.float64:
            raise TypeError(f"backend='triton' takes float16, bfloat16 or float32, got {name} float64")
    if u_pages.dtype != torch.float32:
        raise TypeError(f"backend='triton' takes a float32 u_pages, got {u_pages.dtype}")
    if d > 256:
        raise ValueError(f"backend='triton' takes head_dim up to 256, got {d}")
    if num_splits is not None and not (
        isinstance(num_splits, int) and not isinstance(num_splits, bool) and 1 <= num_splits <= MAX_SPLITS
    ):
        raise ValueError(f"num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")


def castle_paged_decode_step(
    q_c: Tensor,
    k_u: Tensor,
    v_u: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    u_pages: Tensor,
    qu_pages: Tensor,
    page_table: Tensor,
    lengths: Tensor,
    *,
    pos_pages: Tensor | None = None,
    scale: float | None = None,
    window: int | None = None,
    return_key_probs: bool = False,
    num_splits: int | None = None,
    check_values: bool = True,
    backend: str = "auto",
):
    """One CASTLE decode step over a paged store: the lookahead update of every held slot,
    in place, then the new token's output. For each (sequence b, kv head h), with ``n =
    lengths[b, h]`` held slots in logical order (the new token's ``q^U, k^C, v^C`` already
    at slot ``n - 1``, its position ``t = pos[n - 1]``), and each query head of the group::

        u_j += sigmoid(q^U_j . k^U_t * scale) v^U_t   for j < n - 1  (SWL: pos_j >= t - W)
        u_{n-1} = 0
        o = softmax_j(q^C . k^C_j * scale - SiLU(q^C . u_j * scale)) v^C_j,   j < n

    Without eviction (slot ``j`` holds position ``j``) this is
    :func:`castle_decode_step` on the same tokens. With ``page_size = 16``,
    ``lengths[b] = [20, 5]`` and ``page_table[b] = [[7, 2, -1], [4, -1, 9]]``, kv head 0
    reads and updates page 7 (slots 0-15) and slots 0-3 of page 2 (slot 3 of page 2 is
    its new token, set to ``u = 0``), kv head 1 slots 0-4 of page 4; the entries -1 and 9
    are never read or written.

    Args:
        q_c: ``[B, HQ, D]`` the new token's causal queries, any float dtype (float64: the
            attention in float64).
        k_u, v_u: ``[B, HU, D]`` its lookahead key and value, ``HU`` dividing ``HQ``; not kept.
        k_pages, v_pages: ``[P, PS, D]`` the causal keys and values of one layer's pool,
            ``PS`` a power of two >= 16.
        u_pages: ``[P, PS, G, D]`` float32 or float64, contiguous: each slot's lookahead
            vector for each query head of its kv head's group (channel ``g`` of a page of
            kv head ``h`` is query head ``h * G + g``); updated in place.
        qu_pages: ``[P, PS, G, D]`` the slots' lookahead queries, laid out as ``u_pages``.
        page_table: ``[B, H, MP]`` int32, the pages of (b, h) in logical order; entries
            at or past ``ceil(lengths / PS)`` may hold anything.
        lengths: ``[B, H]`` int32 slots held per (b, h), the new token's included, in
            ``[1, MP * PS]``.
        pos_pages: ``[P, PS]`` int32 each slot's absolute position; needed with a window.
        scale: ``1 / sqrt(D)`` by default. window: ``None`` (CASTLE) or ``W >= 1`` (SWL).
        return_key_probs: also return each slot's attention probability summed over the
            ``G`` query heads of its kv head (H2O/A2SF, SPEC section 7).
        num_splits: Triton only, how many splits share each head's slots; by default
            chosen from ``MP * PS`` and ``B * H`` (shapes only) to fill the GPU.
        check_values: check ``lengths`` and the page ids in use (one host read); pass
            False inside a compiled or captured step.
        backend: ``"auto"`` (Triton on CUDA, else torch), ``"triton"`` (one split-K kernel
            that reads each held slot once and updates ``u`` in its page; 16- or 32-bit
            inputs, float32 ``u_pages``, ``D <= 256``), ``"torch"`` (gathered, vectorised,
            fixed shapes under ``torch.compile``) or ``"naive"`` (the per-head reference).

    Slots that no head's length covers are never read and may hold anything (NaN
    included); only held slots are written. An inference op: no gradient through ``u``.

    Returns:
        ``o`` ``[B, HQ, D]`` in ``q_c``'s dtype, or ``(o, key_probs)`` with
        ``return_key_probs``: ``key_probs`` ``[B, H, MP * PS]`` float32, 0 past each
        length, summing to ``G`` over the held slots of each (b, h).

    Example::

        >>> b, hq, h, d, ps, pages = 1, 4, 2, 8, 16, 4
        >>> q_c, k_u, v_u = (torch.randn(b, hq, d) for _ in range(3))
        >>> k_pages, v_pages = torch.randn(pages, ps, d), torch.randn(pages, ps, d)
        >>> u_pages = torch.zeros(pages, ps, hq // h, d)
        >>> qu_pages = torch.randn(pages, ps, hq // h, d)
        >>> table = torch.tensor([[[2, 0], [1, 3]]], dtype=torch.int32)
        >>> lengths = torch.tensor([[5, 17]], dtype=torch.int32)
        >>> castle_paged_decode_step(q_c, k_u, v_u, k_pages, v_pages, u_pages, qu_pages,
        ...                          table, lengths).shape
        torch.Size([1, 4, 8])
    """
    scale, window, backend = _validate(q_c, k_u, v_u, k_pages, v_pages, u_pages, qu_pages, pos_pages,
                                       page_table, lengths, scale, window, num_splits, check_values,
                                       backend)
    with torch.no_grad():
        if backend == "triton":
            o, key_probs = triton_castle_paged_decode(
                q_c, k_u, v_u, k_pages, v_pages, u_pages, qu_pages, pos_pages if window is not None else None,
                page_table, lengths, scale, window, return_key_probs, num_splits)
        else:
            path = _paged_step_naive if backend == "naive" else _paged_step_torch
            o, key_probs = path(q_c, k_u, v_u, k_pages, v_pages, u_pages, qu_pages, pos_pages, page_table,
                                lengths, scale, window, return_key_probs)
    return (o, key_probs) if return_key_probs else o
