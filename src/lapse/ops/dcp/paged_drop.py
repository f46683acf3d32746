"""One decode step's drops over a paged store (SPEC section 6, inference): the new token's
interaction query against every held slot's interaction key, ``z = q_int . k_int / sqrt(r)
+ beta``, and each earlier slot with ``z <= 0`` flagged dropped in every kv head's pages.

The interaction key of a slot is split across the kv heads' pages (``r / K`` values per
head, padded: ``lapse.layers.dcp``), and every head of a layer holds the same slots. The
torch path gathers the keys of the table's whole width and updates the flags through
the table (the reference); the Triton kernel reads only the slots below each sequence's
length, in the keys' own dtype, and writes only the flags that change: one kernel instead
of a gather, a float32 copy, a matrix-vector product and a scatter over the full width
(H100, 64 x 1920, 5 layers: ~90 us of the DCP step's ~200 per layer).

Shapes: B batch, K kv heads, G query heads per kv head, P pages, S page size, Wp table
pages per head, r interaction dim, part = ceil(r / K).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..backend import check_backend, resolve_backend, tl, triton, triton_jit
from ..paging import slot_index
from .common import LOG_FLOOR
from .mask import interaction_logits

BLOCK = 64  # slots per program


def _drop_torch(q_int, kint_pages, drop_pages, page_table, lengths, beta) -> None:
    b, kh, wp = page_table.shape
    s, part = kint_pages.shape[1], kint_pages.shape[2]
    r = q_int.shape[-1]
    width = wp * s
    slots = torch.arange(width, device=q_int.device)  # [W]
    # [B, K, W] each slot's page (unowned: the scratch page) and offset
    pages, offsets, _ = slot_index(page_table, lengths, kint_pages.shape[0], width, s)
    held = kint_pages[pages, offsets]  # [B, K, W, part]
    held = held.permute(0, 2, 1, 3).reshape(b, width, kh * part)[..., :r]  # [B, W, r]
    z = interaction_logits(q_int[:, None], held.to(q_int.dtype), beta)[:, 0]  # [B, W]
    earlier = slots[None, :] < (lengths[:, :1].long() - 1)  # [B, W]: held, not the new token
    newly = (earlier & (z <= 0))[:, None, :, None]  # [B, 1, W, 1]
    drop_pages[pages, offsets] = torch.where(newly, -LOG_FLOOR, drop_pages[pages, offsets])


@triton_jit
def _drop_kernel(
    q_ptr,
    kint_ptr,
    drop_ptr,
    table_ptr,
    len_ptr,
    beta_ptr,
    stride_qb,
    stride_kp,
    stride_ks,
    stride_dp,
    stride_ds,
    stride_tb,
    stride_th,
    stride_lb,
    R,
    NPART,
    G,
    scale,
    neg_floor,
    K: tl.constexpr,
    S: tl.constexpr,
    PART: tl.constexpr,
    BLOCK: tl.constexpr,
    BG: tl.constexpr,
):
    i_b, i_w = tl.program_id(0).to(tl.int64), tl.program_id(1)
    n = tl.load(len_ptr + i_b * stride_lb)  # the sequence's length (every head holds the same slots)
    o_w = i_w * BLOCK + tl.arange(0, BLOCK)
    m_w = o_w < n - 1  # earlier slots: the new token's own is never dropped by itself
    if i_w * BLOCK >= n - 1:
        return
    o_i = tl.arange(0, PART)
    z = tl.zeros([BLOCK], dtype=tl.float32)
    # the heads unrolled: their table lookups and key loads are all in flight at once (a
    # loop over a runtime K issued them one head after another)
    for h in tl.static_range(K):
        page = tl.load(table_ptr + i_b * stride_tb + h * stride_th + o_w // S, mask=m_w, other=0).to(tl.int64)
        o_k = h * NPART + o_i  # this head's slice of the interaction dim
        m_k = (o_i < NPART) & (o_k < R)
        b_k = tl.load(
            kint_ptr + page[:, None] * stride_kp + (o_w % S)[:, None] * stride_ks + o_i[None, :],
            mask=m_w[:, None] & m_k[None, :],
            other=0.0,
        ).to(tl.float32)
        b_q = tl.load(q_ptr + i_b * stride_qb + o_k, mask=m_k, other=0.0).to(tl.float32)
        z += tl.sum(b_k * b_q[None, :], axis=1)
    z = z * scale + tl.load(beta_ptr).to(tl.float32)
    newly = m_w & (z <= 0.0)
    o_g = tl.arange(0, BG)
    for h in tl.static_range(K):
        page = tl.load(table_ptr + i_b * stride_tb + h * stride_th + o_w // S, mask=newly, other=0).to(
            tl.int64
        )
        ptr = drop_ptr + page[:, None] * stride_dp + (o_w % S)[:, None] * stride_ds + o_g[None, :]
        tl.store(
            ptr, tl.zeros([BLOCK, BG], dtype=tl.float32) + neg_floor, mask=newly[:, None] & (o_g < G)[None, :]
        )


def _check(q_int, kint_pages, drop_pages, page_table, lengths) -> None:
    for name, t in (
        ("q_int", q_int),
        ("kint_pages", kint_pages),
        ("drop_pages", drop_pages),
        ("page_table", page_table),
        ("lengths", lengths),
    ):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != q_int.device:
            raise ValueError(f"{name} is on {t.device} but q_int is on {q_int.device}")
    if q_int.dim() != 2 or kint_pages.dim() != 3 or drop_pages.dim() != 3 or page_table.dim() != 3:
        shapes = [tuple(t.shape) for t in (q_int, kint_pages, drop_pages, page_table)]
        raise ValueError(
            "expected q_int [B, r], kint_pages [P, S, part], drop_pages [P, S, G], page_table [B, K, Wp]; "
            f"got {shapes}"
        )
    b, kh, _ = page_table.shape
    if q_int.shape[0] != b or tuple(lengths.shape) != (b, kh):
        raise ValueError(
            f"q_int {tuple(q_int.shape)} and lengths {tuple(lengths.shape)} must match the table's "
            f"[B, K] = {(b, kh)}"
        )
    if kint_pages.shape[2] * kh < q_int.shape[1]:
        raise ValueError(
            f"kint_pages hold {kint_pages.shape[2]} x {kh} heads < r = {q_int.shape[1]} values per slot"
        )
    if drop_pages.dtype != torch.float32 or drop_pages.shape[:2] != kint_pages.shape[:2]:
        raise ValueError("drop_pages must be float32 [P, S, G] beside kint_pages [P, S, part]")


def dcp_paged_drop(
    q_int: Tensor,
    kint_pages: Tensor,
    drop_pages: Tensor,
    page_table: Tensor,
    lengths: Tensor,
    beta: float | Tensor,
    *,
    backend: str = "auto",
) -> None:
    """Flags (in place, ``drop_pages = -LOG_FLOOR``) every held slot before the newest that
    the new token's interaction query drops, ``q_int . k_int / sqrt(r) + beta <= 0``.

    Args:
        q_int: ``[B, r]`` the new token's interaction query (any floating dtype).
        kint_pages: ``[P, S, part]`` the interaction keys, each kv head's slice in its pages.
        drop_pages: ``[P, S, G]`` float32 flags (0 kept, ``-LOG_FLOOR`` dropped), updated.
        page_table: ``[B, K, Wp]`` int32 pages of each (sequence, kv head), ``-1`` unowned.
        lengths: ``[B, K]`` int32 held tokens per head, the new one included (all heads equal).
        beta: the layer's offset (a number or a one-element tensor).
        backend: ``"auto"`` (Triton on CUDA), ``"triton"`` or ``"torch"`` (the reference).
    """
    _check(q_int, kint_pages, drop_pages, page_table, lengths)
    check_backend(backend, ("auto", "triton", "torch"))
    if backend == "auto":
        backend = "triton" if q_int.is_cuda and q_int.dtype != torch.float64 else "torch"
    if backend == "torch":
        return _drop_torch(q_int, kint_pages, drop_pages, page_table, lengths, beta)
    # Triton usable for these inputs (its kernel multiplies no tiles)
    resolve_backend(backend, q_int, ("auto", "triton", "torch"), products=False)
    beta_t = (
        beta.detach().reshape(())
        if isinstance(beta, Tensor)
        else torch.full((), float(beta), device=q_int.device)
    )
    triton_paged_drop(q_int, kint_pages, drop_pages, page_table, lengths, beta_t)


@torch.library.custom_op("lapse::dcp_paged_drop", mutates_args=("drop_pages",))
def triton_paged_drop(
    q_int: Tensor, kint_pages: Tensor, drop_pages: Tensor, page_table: Tensor, lengths: Tensor, beta: Tensor
) -> None:
    """:func:`launch_drop` as one operator that ``torch.compile`` calls without tracing into."""
    launch_drop(q_int, kint_pages, drop_pages, page_table, lengths, beta)


@triton_paged_drop.register_fake
def _(q_int, kint_pages, drop_pages, page_table, lengths, beta):
    return None


def launch_drop(q_int, kint_pages, drop_pages, page_table, lengths, beta_t, block: int = BLOCK) -> None:
    b, kh, wp = page_table.shape
    s, part = kint_pages.shape[1], kint_pages.shape[2]
    g = drop_pages.shape[2]
    if kint_pages.stride(2) != 1 or drop_pages.stride(2) != 1 or page_table.stride(2) != 1:
        raise ValueError("kint_pages, drop_pages and page_table must be contiguous in their last dim")
    grid = (b, triton.cdiv(wp * s, block))
    _drop_kernel[grid](
        q_int,
        kint_pages,
        drop_pages,
        page_table,
        lengths,
        beta_t,
        q_int.stride(0),
        kint_pages.stride(0),
        kint_pages.stride(1),
        drop_pages.stride(0),
        drop_pages.stride(1),
        page_table.stride(0),
        page_table.stride(1),
        lengths.stride(0),
        q_int.shape[1],
        part,
        g,
        1.0 / math.sqrt(q_int.shape[1]),
        -LOG_FLOOR,
        K=kh,
        S=s,
        PART=triton.next_power_of_2(part),
        BLOCK=block,
        BG=triton.next_power_of_2(g),
    )
