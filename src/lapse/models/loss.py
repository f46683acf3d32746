"""The language-model loss fused with the output projection, a chunk of positions at a time.

``lm_loss(lm_head(hidden), labels)`` holds the ``[B, T, V]`` logits, their float32 copy and
their gradient: at a 50k vocabulary that is most of a long-context step's memory. Here the
``B * T`` rows of ``hidden`` are projected ``chunk`` rows at a time, and each chunk's loss
*and* its gradients with respect to ``hidden`` and the head's weight are computed at once,
in the forward (a chunk's logits are never needed again). The backward only scales the
stored gradients by the loss's gradient. Peak extra memory: one chunk's logits (a few
copies of ``chunk x V``), the gradients ``[B, T, C]`` and ``[V, C]``, and a float32
accumulator ``[V, C]``; it grows with ``T x C``, not ``T x V``.

The reference is :func:`lapse.models.decoder.lm_loss` of ``F.linear(hidden, weight)``.

Shapes are the names' suffixes (``h_NC`` is ``[N, C]``): N rows (``B * T`` flattened), n rows of
one chunk, C d_model, V vocab.
"""

from __future__ import annotations

import torch
from torch import Tensor

IGNORE_INDEX = -100
CHUNK_BYTES = 256 * 2**20  # one chunk's float32 logits


def chunk_rows(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk whose float32 logits take at most ``chunk_bytes`` (at least one):
    1,334 at a vocabulary of 50,304."""
    return max(1, chunk_bytes // (4 * vocab_size))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        chunk: int,
        compute: torch.dtype,
        grad_hidden: bool,
        grad_weight: bool,
    ) -> Tensor:
        acc = torch.promote_types(compute, torch.float32)  # float32, or float64 for float64
        h_NC = hidden.reshape(-1, hidden.shape[-1])
        y_N = labels.reshape(-1)
        w_VC = weight.to(compute)
        valid_N = y_N != IGNORE_INDEX
        count = valid_N.sum()
        # F.cross_entropy's mean: nan when every label is left out; its gradient is then 0
        scale = 1.0 / count.clamp(min=1).to(acc)
        # summed once at the end, as F.cross_entropy sums them (not chunk by chunk)
        loss_N = torch.empty(h_NC.shape[0], dtype=acc, device=hidden.device)
        dh_NC = torch.empty(h_NC.shape, dtype=hidden.dtype, device=hidden.device) if grad_hidden else None
        dw_VC = torch.zeros(w_VC.shape, dtype=acc, device=weight.device) if grad_weight else None
        for start in range(0, h_NC.shape[0], chunk):
            h_nC = h_NC[start : start + chunk].to(compute)
            valid_n = valid_N[start : start + chunk]
            y_n1 = torch.where(valid_n, y_N[start : start + chunk], 0)[:, None]
            z_nV = (h_nC @ w_VC.T).to(acc)  # the chunk's logits, in the head's dtype first
            # log_softmax's order of operations, in place in one [n, V] buffer
            z_nV.sub_(z_nV.amax(-1, keepdim=True))
            zy_n = z_nV.gather(1, y_n1).squeeze(1)  # the label's shifted logit
            e_nV = z_nV.exp_()
            s_n = e_nV.sum(-1)
            loss_N[start : start + chunk] = (s_n.log() - zy_n) * valid_n
            if not (grad_hidden or grad_weight):
                continue
            # d loss / d logits = (softmax - onehot(label)) / count on the rows kept, 0 elsewhere
            p_nV = e_nV.div_(s_n[:, None])
            p_nV.scatter_add_(1, y_n1, torch.full_like(y_n1, -1, dtype=acc))
            d_nV = p_nV.mul_((valid_n * scale)[:, None]).to(compute)
            if grad_hidden:
                dh_NC[start : start + chunk] = d_nV @ w_VC
            if grad_weight:
                dw_VC += (d_nV.T @ h_nC).to(acc)
        ctx.save_for_backward(
            None if dh_NC is None else dh_NC.view(hidden.shape),
            None if dw_VC is None else dw_VC.to(weight.dtype),
        )
        return loss_N.sum() / count

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        dh, dw = ctx.saved_tensors
        return (
            None if dh is None else dh * grad_loss,
            None if dw is None else dw * grad_loss,
            None, None, None, None, None,
        )


# Eager, never compiled: a compiled forward would unroll the loop over chunks into one graph
# whose scheduler is free to keep several chunks' logits alive at once (the whole point is
# that one chunk's are freed before the next one's are made). Under prepare_blocks' compiled
# blocks this is a graph break after the final norm, where the compiled region ends anyway.
@torch.compiler.disable
def chunked_lm_loss(hidden: Tensor, weight: Tensor, labels: Tensor, chunk: int) -> Tensor:
    """Mean cross-entropy of the logits ``hidden @ weight.T`` against ``labels``, without
    ever making the logits of more than ``chunk`` rows.

    Equals ``lm_loss(F.linear(hidden, weight), labels)`` (:mod:`lapse.models.decoder`), its
    value and its gradients with respect to ``hidden`` and ``weight``, up to the order of
    float32 sums.

    Args:
        hidden: ``[B, T, C]`` the final-norm output (:meth:`Decoder.hidden_states`).
        weight: ``[V, C]`` the output head's weight (``nn.Linear(C, V, bias=False)``), a
            plain tensor (under FSDP2 the gathered one the forward sees).
        labels: ``[B, T]`` integer targets; ``-100`` leaves a position out.
        chunk: rows of the flattened ``[B * T]`` per chunk (:func:`chunk_rows`).

    Returns:
        The mean over the labels kept, a float32 scalar (float64 for float64 inputs); nan
        where every label is left out, as ``F.cross_entropy``, with zero gradients.

    Dtypes: the projection is computed in the dtype ``nn.Linear`` would use (autocast's
    when it is on, else the inputs' promoted dtype), so bf16 training keeps the head on
    bf16 matrix units; its output and everything after it in float32 (float64 for float64
    inputs), as ``lm_loss``. The gradients come back in ``hidden``'s and ``weight``'s
    dtypes; they are computed in the forward, only for the inputs that require them while
    grad mode is on (without it, one matmul per chunk).
    """
    if hidden.dim() != 3 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden [B, T, C] and weight [V, C] expected, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if tuple(labels.shape) != tuple(hidden.shape[:2]) or labels.is_floating_point():
        raise ValueError(f"labels must be integers of shape {tuple(hidden.shape[:2])}, got "
                         f"{labels.dtype} {tuple(labels.shape)}")
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 row, got {chunk}")
    device = hidden.device.type
    compute = torch.promote_types(hidden.dtype, weight.dtype)
    if torch.is_autocast_enabled(device) and compute != torch.float64:  # autocast leaves float64 alone
        compute = torch.get_autocast_dtype(device)
    grad = torch.is_grad_enabled()
    grad_hidden, grad_weight = grad and hidden.requires_grad, grad and weight.requires_grad
    with torch.autocast(device, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(
            hidden, weight, labels, chunk, compute, grad_hidden, grad_weight
        )
