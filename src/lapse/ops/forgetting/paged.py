"""Attention of one new token per sequence over a paged, per-head KV store.

SPEC section 1 (Decoding) for FoX; plain softmax attention (RoPE already applied to the
cached keys) when no ``c`` is given; SPEC section 7 for the per-key probabilities that
H2O/A2SF accumulate. The store (``lapse.kv.paged``) gives every (sequence, kv head) its
own page table and length, because eviction keeps a different number of tokens per head:
logical slot ``i`` of (b, h) is page ``page_table[b, h, i // page_size]`` at offset
``i % page_size``.

The file reads: the plain reference (``naive``), the gathered torch path (``torch``, what
CPUs run), the checks, the public function. The Triton path (split-K kernels reading pages
through the table) is in ``paged_triton.py``.

Legend: B batch, H key/value heads, HQ query heads, G = HQ // H, D head dim, P pages in
the pool, PS page size, MP pages per head in the table, L = MP * PS logical slots.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backend import BACKENDS, check_backend, resolve_backend
from .common import _shape, check_devices, check_float_dtype, check_tensors, resolve_scale
from .decode_triton import MAX_SPLITS
from .paged_triton import triton_paged_decode

MIN_PAGE_SIZE = 16


def _paged_decode_naive(
    q: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    page_table: Tensor,
    lengths: Tensor,
    c_pages: Tensor | None,
    c_query: Tensor | None,
    scale: float,
    return_key_probs: bool,
) -> tuple[Tensor, Tensor | None]:
    """The plain reference: each head's pages gathered into a dense ``[L, D]`` view, slots
    at or past the head's length masked explicitly.

    Float32 math (float64 for float64 ``q``); the bias ``c_t - c_j`` is taken in ``c``'s
    dtype first. Table entries past a head's pages are replaced by page 0 before the
    gather and every slot past the length is zeroed before use, so garbage (NaN, -1, a
    stale page id) there cannot leak in.
    """
    b, hq, d = q.shape
    _, h, max_pages = page_table.shape
    page_size = k_pages.shape[1]
    g, n_slots = hq // h, max_pages * page_size
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    n = lengths.long()  # [B, H]
    used = torch.arange(max_pages, device=q.device) < ((n + page_size - 1) // page_size)[..., None]
    pages = torch.where(used, page_table, 0).long()  # [B, H, MP]
    keep = torch.arange(n_slots, device=q.device) < n[..., None]  # [B, H, L]
    k = k_pages[pages].reshape(b, h, n_slots, d)  # [B, H, L, D]
    v = v_pages[pages].reshape(b, h, n_slots, d)  # [B, H, L, D]
    k = torch.where(keep[..., None], k, 0.0).to(acc)
    v = torch.where(keep[..., None], v, 0.0).to(acc)
    q_g = q.reshape(b, h, g, d).to(acc)  # [B, H, G, D]
    logits = torch.einsum("bhgd,bhld->bhgl", q_g, k) * scale  # [B, H, G, L]
    if c_pages is not None:
        c_k = c_pages[pages].reshape(b, h, n_slots, g)  # [B, H, L, G], c's dtype
        c_t = c_query.reshape(b, h, 1, g)  # [B, H, 1, G]
        bias = torch.where(keep[..., None], c_t - c_k, 0.0).to(acc)  # [B, H, L, G]
        logits = logits + bias.transpose(2, 3)
    logits = logits.masked_fill(~keep[:, :, None, :], float("-inf"))
    p = torch.softmax(logits, dim=-1)  # [B, H, G, L]
    o = torch.einsum("bhgl,bhld->bhgd", p, v).reshape(b, hq, d)  # [B, HQ, D]
    key_probs = p.sum(dim=2).float() if return_key_probs else None  # [B, H, L]
    return o.to(q.dtype), key_probs


def _paged_decode_torch(
    q: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    page_table: Tensor,
    lengths: Tensor,
    c_pages: Tensor | None,
    c_query: Tensor | None,
    scale: float,
    return_key_probs: bool,
) -> tuple[Tensor, Tensor | None]:
    """The reference's math with less memory traffic, for CPUs (a decode step calls it once
    per layer): only the pages up to the longest head's are gathered (on the CPU, outside
    compiled code; elsewhere the whole table, so no host sync), with one ``index_select``
    per pool; only ``v`` is zeroed past each length (a key or ``c`` there makes a garbage
    logit that the ``-inf`` fill replaces, while ``0 * NaN`` in ``p @ v`` would stay NaN);
    batched ``matmul`` instead of ``einsum``. Same outputs as :func:`_paged_decode_naive`,
    ``key_probs`` padded with zeros to the table's ``L``."""
    b, hq, d = q.shape
    _, h, max_pages = page_table.shape
    page_size = k_pages.shape[1]
    g = hq // h
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    n = lengths.long()  # [B, H]
    n_pages = (n + page_size - 1) // page_size  # [B, H]
    # on the CPU, outside compiled code, data-dependent sizes cost no sync
    host = q.device.type == "cpu" and not torch.compiler.is_compiling()
    mp = min(max_pages, max(1, int(n_pages.max()))) if host else max_pages
    n_slots = mp * page_size
    used = torch.arange(mp, device=q.device) < n_pages[..., None]  # [B, H, mp]
    pages = torch.where(used, page_table[..., :mp], 0).long().flatten()  # [B * H * mp]
    past = torch.arange(n_slots, device=q.device) >= n[..., None]  # [B, H, L']
    k = k_pages.index_select(0, pages).view(b, h, n_slots, d).to(acc)  # [B, H, L', D]
    v = v_pages.index_select(0, pages).view(b, h, n_slots, d)  # a copy: zeroed in place
    if host:  # the rows past the lengths only (a broadcast masked_fill costs 10x more on CPU)
        v.view(-1, d).index_fill_(0, past.flatten().nonzero().squeeze(1), 0)
    else:
        v = v.masked_fill(past[..., None], 0)
    v = v.to(acc)  # [B, H, L', D]
    # One path with and without the probabilities (an SDPA call for the latter rounds
    # differently: a Dense policy would then not give exactly the dense store's logits when
    # another run tracks scores).
    q_g = q.view(b, h, g, d).to(acc)  # [B, H, G, D]
    logits = torch.matmul(q_g, k.transpose(2, 3)) * scale  # [B, H, G, L']
    if c_pages is not None:
        c_k = c_pages.index_select(0, pages).view(b, h, n_slots, g)  # [B, H, L', G], c's dtype
        bias = c_query.view(b, h, 1, g) - c_k  # [B, H, L', G]
        logits = logits + bias.transpose(2, 3).to(acc)
    logits = logits.masked_fill(past[:, :, None, :], float("-inf"))
    p = torch.softmax(logits, dim=-1)  # [B, H, G, L']
    o = torch.matmul(p, v).reshape(b, hq, d)  # [B, HQ, D]
    key_probs = None
    if return_key_probs:
        key_probs = p.sum(dim=2).float()  # [B, H, L']
        if mp < max_pages:
            key_probs = torch.nn.functional.pad(key_probs, (0, (max_pages - mp) * page_size))
    return o.to(q.dtype), key_probs


def _validate(
    q: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    page_table: Tensor,
    lengths: Tensor,
    c_pages: Tensor | None,
    c_query: Tensor | None,
    scale: float | None,
    num_splits: int | None,
    check_values: bool,
    backend: str,
) -> float:
    """Checks every argument (values only with ``check_values``) and returns the scale."""
    tensors = dict(q=q, k_pages=k_pages, v_pages=v_pages, page_table=page_table, lengths=lengths)
    if (c_pages is None) != (c_query is None):
        raise ValueError(
            "c_pages and c_query must be given together (FoX) or both left None (softmax)"
        )
    if c_pages is not None:
        tensors |= dict(c_pages=c_pages, c_query=c_query)
    check_tensors(**tensors)
    check_devices(**tensors)
    check_backend(backend, BACKENDS)
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, query_heads, head_dim], got {_shape(q)}")
    check_float_dtype("q", q)
    if k_pages.dim() != 3:
        raise ValueError(f"k_pages must be [pages, page_size, head_dim], got {_shape(k_pages)}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages and v_pages must have the same shape, got {_shape(k_pages)} and "
            f"{_shape(v_pages)}"
        )
    if not (q.dtype == k_pages.dtype == v_pages.dtype):
        raise TypeError(
            f"q, k_pages, v_pages must share a dtype, got {q.dtype}, {k_pages.dtype}, "
            f"{v_pages.dtype}"
        )
    b, hq, d = q.shape
    n_pages, page_size, dk = k_pages.shape
    if dk != d:
        raise ValueError(f"k_pages has head_dim {dk} but q has head_dim {d}")
    if d < 1 or d > 256:
        raise ValueError(f"head_dim must be in [1, 256], got {d}")
    if n_pages < 1:
        raise ValueError(f"k_pages must hold at least one page, got {_shape(k_pages)}")
    if page_size < MIN_PAGE_SIZE or page_size & (page_size - 1):
        raise ValueError(
            f"page_size (k_pages.shape[1]) must be a power of two >= {MIN_PAGE_SIZE}, "
            f"got {page_size}"
        )
    if page_table.dtype != torch.int32 or page_table.dim() != 3:
        raise ValueError(
            f"page_table must be int32 [batch, kv_heads, max_pages], got {_shape(page_table)}"
        )
    _, h, max_pages = page_table.shape
    if page_table.shape[0] != b:
        raise ValueError(f"page_table has batch {page_table.shape[0]} but q has batch {b}")
    if h < 1 or hq % h != 0:
        raise ValueError(
            f"query heads ({hq}) must be a multiple of key/value heads ({h}) (grouped-query)"
        )
    if max_pages < 1:
        raise ValueError(f"page_table must have at least one page per head, got {_shape(page_table)}")
    if lengths.dtype != torch.int32 or tuple(lengths.shape) != (b, h):
        raise ValueError(f"lengths must be int32 [batch, kv_heads] = {(b, h)}, got {_shape(lengths)}")
    if c_pages is not None:
        g = hq // h
        for name, t in (("c_pages", c_pages), ("c_query", c_query)):
            if t.dtype not in (torch.float32, torch.float64):
                raise TypeError(f"{name} must be float32 or float64, got {t.dtype}")
        if c_query.dtype != c_pages.dtype:
            raise TypeError(
                f"c_query must have c_pages's dtype {c_pages.dtype}, got {c_query.dtype}"
            )
        if tuple(c_pages.shape) != (n_pages, page_size, g):
            raise ValueError(
                f"c_pages must be [pages, page_size, query_heads // kv_heads] = "
                f"{(n_pages, page_size, g)}, got {_shape(c_pages)}"
            )
        if tuple(c_query.shape) != (b, hq):
            raise ValueError(f"c_query must be [batch, query_heads] = {(b, hq)}, got {_shape(c_query)}")
    if num_splits is not None and not (
        isinstance(num_splits, int) and not isinstance(num_splits, bool)
        and 1 <= num_splits <= MAX_SPLITS
    ):
        raise ValueError(f"num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    scale = resolve_scale(scale, d)
    if check_values:
        n_slots = max_pages * page_size
        if bool(((lengths < 1) | (lengths > n_slots)).any()):
            raise ValueError(
                f"lengths must be in [1, max_pages * page_size = {n_slots}], "
                f"got {lengths.flatten().tolist()[:16]}"
            )
        n_used = (lengths.long() + page_size - 1) // page_size  # [B, H]
        used = torch.arange(max_pages, device=q.device) < n_used[..., None]  # [B, H, MP]
        bad = used & ((page_table < 0) | (page_table >= n_pages))
        if bool(bad.any()):
            b_, h_, i_ = (int(x) for x in bad.nonzero()[0])
            raise ValueError(
                f"page_table must hold page ids in [0, pages = {n_pages}) for the pages in use, "
                f"got {int(page_table[b_, h_, i_])} at [{b_}, {h_}, {i_}]"
            )
    return scale


def forgetting_attention_paged_decode(
    q: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    page_table: Tensor,
    lengths: Tensor,
    *,
    c_pages: Tensor | None = None,
    c_query: Tensor | None = None,
    scale: float | None = None,
    return_key_probs: bool = False,
    num_splits: int | None = None,
    check_values: bool = True,
    backend: str = "auto",
):
    """Attention of one new token per sequence over a paged store with a page table and a
    length per (sequence, kv head), with the forget-gate bias (FoX) or without (softmax).

    ``o_hq = softmax_j(scale * q_hq . k_j + c_t,hq - c_j,hq) v_j`` over the logical slots
    ``j < lengths[b, h]`` of the kv head ``h = hq // G`` (SPEC section 1); without ``c``
    the bias is 0 (plain softmax attention, RoPE already applied to the cached keys). The
    new token's own key, value and ``c`` are already stored at slot ``lengths - 1``. With
    ``page_size = 16``, ``lengths[b] = [20, 5]`` and ``page_table[b] = [[7, 2, -1],
    [4, -1, 9]]``, kv head 0 reads page 7 (slots 0-15) and slots 0-3 of page 2, kv head 1
    reads slots 0-4 of page 4; the entries -1 and 9 are never read.

    Args:
        q: ``[B, HQ, D]`` float16, bfloat16 or float32 (float64 on the torch backend), the
            new token's queries. ``D`` up to 256, any value.
        k_pages, v_pages: ``[P, PS, D]`` the pools of one layer, ``q``'s dtype; the page
            size ``PS`` a power of two >= 16. Slots that no head's length covers are
            never read and may hold anything.
        page_table: ``[B, H, MP]`` int32, the pages of (sequence b, kv head h) in logical
            order; ``HQ`` a multiple of ``H`` (grouped-query: query head ``hq`` reads kv
            head ``hq // G``). Entries at or past ``ceil(lengths / PS)`` may hold anything.
        lengths: ``[B, H]`` int32 tokens held by each (sequence, kv head), in
            ``[1, MP * PS]``.
        c_pages: FoX only, ``[P, PS, G]`` float64 or float32, the cumulative log gate
            ``c_j`` of each held key for each query head of its kv head's group (channel
            ``g`` of a page of kv head ``h`` is query head ``h * G + g``); finite (build it
            with ``cumulative_log_gates``). The bias ``c_t - c_j`` is taken in this dtype
            and only then rounded to float32, so float64 keeps it exact at long context
            (SPEC section 1, Numerics).
        c_query: FoX only, ``[B, HQ]`` in ``c_pages``'s dtype, the new token's ``c_t``.
        scale: logit scale, ``1 / sqrt(D)`` by default.
        return_key_probs: also return, for each slot, its attention probability summed over
            the ``G`` query heads of its kv head (what H2O/A2SF accumulate, SPEC section 7).
        num_splits: Triton only, how many splits share each head's slots; by default chosen
            from ``L`` and ``B * H`` (shapes only) to fill the GPU.
        check_values: check ``lengths`` and the page ids in use (one host-device sync);
            pass False inside a captured or compiled decode step.
        backend: ``"auto"`` (Triton on CUDA, else torch), ``"triton"``, ``"torch"`` (the
            gathered path, any device) or ``"naive"`` (the plain reference, any device).

    Returns:
        ``o`` ``[B, HQ, D]`` in ``q``'s dtype, or ``(o, key_probs)`` with
        ``return_key_probs``: ``key_probs`` ``[B, H, L]`` float32, exactly 0 at slots
        ``>= lengths[b, h]``; it sums to ``G`` over the slots of each (b, h). An inference
        op: the Triton path records no gradient.
    """
    scale = _validate(q, k_pages, v_pages, page_table, lengths, c_pages, c_query, scale,
                      num_splits, check_values, backend)
    backend = resolve_backend(backend, q, BACKENDS)
    if backend == "triton":
        with torch.no_grad():  # an inference op: no gradient through the kernels
            o, key_probs = triton_paged_decode(q, k_pages, v_pages, page_table, lengths,
                                               c_pages, c_query, scale, return_key_probs,
                                               num_splits)
    else:
        path = _paged_decode_torch if backend == "torch" else _paged_decode_naive
        o, key_probs = path(q, k_pages, v_pages, page_table, lengths, c_pages, c_query, scale,
                            return_key_probs)
    return (o, key_probs) if return_key_probs else o
