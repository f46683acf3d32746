"""Context parallelism: one sequence split across the ranks of a process group.

A sequence of length ``T`` (a multiple of ``2N``) is cut into ``2N`` equal chunks of
``n = T / 2N`` tokens, and rank ``r`` of ``N`` holds chunks ``r`` and ``2N - 1 - r``, in
that order: ``[B, 2n, ...]``. Under a causal mask a query chunk's work grows with its
index, so the mirrored pair gives every rank the same work. Everything outside attention
is per token and runs on the local tokens as it is; the layers ask this object for what
needs other tokens:

- :meth:`positions`: the global positions of the local tokens (RoPE);
- :meth:`shift_right`: each token's predecessor in the whole sequence (the Pro block's
  KV-shift), the first token of each chunk taken from the rank that holds the one before;
- :meth:`attend`: a kind's causal attention over the whole sequence, in one of two modes:

  ``head`` (an all-to-all, as in DeepSpeed-Ulysses): each rank receives every rank's
  tokens for its ``H / N`` query heads and ``K / N`` key/value heads, runs the kind's
  attention over the whole sequence, and sends each rank its tokens' outputs back. Every
  kind whose inputs are per head runs unchanged; the head counts must divide by ``N``.

  ``gather`` (an all-gather of the keys, as Llama 3's context parallelism): each rank
  gathers every token's keys, values and per-key inputs (FoX's log forget gates) and
  attends each of its query chunks to the keys up to the chunk's end, the queries at the
  end of the keys, which is how the attention ops align ``Tq < Tk``. Gradients of the
  gathered tensors are summed back on their owners. With FoX the op sees the same
  biases ``c_i - c_j`` as in one process, so ACP prunes the same tiles; the keys a
  query chunk never reaches are not read. Serves the kinds whose attention takes only
  ``q, k, v`` and per-key tensors (softmax, forgetting).

The collectives are torch's functional ones with autograd
(``torch.distributed._functional_collectives``, as torchtitan uses them): the model trains
through them, and ``torch.compile`` traces them into a block's graph.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

CP_MODES = ("head", "gather")

# the name of torch 2.13 on, the one before it (torch 2.11: only the older)
_all_gather_autograd = (getattr(funcol, "all_gather_single_autograd", None)
                        or funcol.all_gather_tensor_autograd)


@dataclass(frozen=True, eq=False)
class ContextParallel:
    """This rank's share of every sequence: ``rank`` of ``size`` ranks of ``group``.

    Use :meth:`of` to make one from a process group; ``Decoder.set_context`` gives it to
    the model and its layers, and :meth:`split` gives each rank its tokens of a batch."""

    group: object | None
    size: int
    rank: int
    mode: Literal["head", "gather"] = "head"

    @classmethod
    def of(cls, group=None, mode: str = "head") -> ContextParallel:
        """The context parallelism of ``group`` (the default group when ``None``)."""
        if mode not in CP_MODES:
            raise ValueError(f"cp mode must be one of {', '.join(CP_MODES)}, got {mode!r}")
        if not dist.is_initialized():
            raise RuntimeError("context parallelism needs a process group (run under torchrun)")
        return cls(group, dist.get_world_size(group), dist.get_rank(group), mode)

    # -- the layout ------------------------------------------------------------------------

    @property
    def chunks(self) -> tuple[int, int]:
        """The indices of the two chunks this rank holds, of ``2 * size``."""
        return self.rank, 2 * self.size - 1 - self.rank

    def padded_length(self, t: int) -> int:
        """The smallest multiple of ``2 * size`` that holds ``t`` tokens."""
        m = 2 * self.size
        return -(-t // m) * m

    def split(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's tokens of ``x``, whose ``dim`` is a whole sequence of a length
        :meth:`padded_length` gives."""
        t = x.shape[dim]
        if t % (2 * self.size):
            raise ValueError(
                f"a sequence of {t} tokens does not split into {2 * self.size} equal chunks "
                f"(context parallelism over {self.size} ranks); pad it to {self.padded_length(t)}"
            )
        n = t // (2 * self.size)
        a, b = self.chunks
        return torch.cat([x.narrow(dim, a * n, n), x.narrow(dim, b * n, n)], dim)

    def global_length(self, t_local: int) -> int:
        """The whole sequence's length when this rank holds ``t_local`` of its tokens."""
        return t_local * self.size

    def positions(self, t_local: int, device: torch.device | str) -> Tensor:
        """The global positions of this rank's ``t_local`` tokens, ``[1, t_local]``."""
        n = self._chunk_length(t_local)
        a, b = self.chunks
        idx = torch.arange(n, device=device)
        return torch.cat([idx + a * n, idx + b * n])[None]  # [1, 2n]

    def _chunk_length(self, t_local: int) -> int:
        if t_local % 2:
            raise ValueError(f"a rank holds two chunks of equal length, got {t_local} tokens")
        return t_local // 2

    def _in_order(self, pieces: list[Tensor] | tuple[Tensor, ...], dim: int = 1) -> Tensor:
        """Every rank's local tokens (``pieces[s]``: rank ``s``'s ``[.., 2n, ..]``) as the
        whole sequence, in order."""
        n = self._chunk_length(pieces[0].shape[dim])
        size = self.size
        parts = []
        for c in range(2 * size):
            owner, half = (c, 0) if c < size else (2 * size - 1 - c, 1)
            parts.append(pieces[owner].narrow(dim, half * n, n))
        return torch.cat(parts, dim)

    # -- collectives with gradients ----------------------------------------------------------

    def _all_gather(self, x: Tensor) -> tuple[Tensor, ...]:
        """Every rank's ``x`` (rank ``s``'s at ``[s]``), with gradients summed back."""
        out = _all_gather_autograd(x.contiguous(), 0, self._group)  # [N * B, ...]
        return out.chunk(self.size, dim=0)

    def _all_to_all(self, parts: list[Tensor]) -> tuple[Tensor, ...]:
        """``parts[s]`` sent to rank ``s``; returns what each rank sent here (from ``s`` at
        ``[s]``); parts of one shape."""
        x = torch.stack(parts).flatten(0, 1)  # [N * B, ...]
        out = funcol.all_to_all_single_autograd(x, None, None, self._group)
        return out.chunk(self.size, dim=0)

    def gather(self, x: Tensor) -> Tensor:
        """The whole sequence ``[B, T, ...]`` of the local ``x`` ``[B, 2n, ...]``; the
        gradient of each token goes back to the rank that holds it."""
        return self._in_order(self._all_gather(x))

    def shift_right(self, x: Tensor) -> Tensor:
        """``y_t = x_{t-1}`` over the whole sequence (``y_0 = 0``), for the local tokens
        ``x`` ``[B, 2n, ...]``: within each chunk a shift, and each chunk's first token the
        last of the chunk before it, from the rank that holds that one."""
        n = self._chunk_length(x.shape[1])
        size = self.size
        lasts = torch.stack([x[:, n - 1], x[:, 2 * n - 1]], dim=1).contiguous()  # [B, 2, ...]
        table = self._all_gather(lasts)  # rank s: its chunks' last tokens
        a, b = self.chunks
        prev_a = torch.zeros_like(x[:, :1]) if a == 0 else table[a - 1][:, :1]  # chunk a-1 < N
        c = b - 1  # the chunk before b: held first by rank c when c < N, else second by 2N-1-c
        prev_b = table[c][:, :1] if c < size else table[2 * size - 1 - c][:, 1:2]
        return torch.cat([prev_a, x[:, : n - 1], prev_b, x[:, n : 2 * n - 1]], dim=1)

    def total(self, x: Tensor) -> Tensor:
        """The sum of ``x`` over the group's ranks (no gradient: counts, statistics)."""
        x = x.detach().clone()
        dist.all_reduce(x, group=self._group)
        return x

    def head_slice(self, heads: int) -> slice:
        """The heads (of ``heads``) this rank attends with in ``head`` mode."""
        g = heads // self.size
        return slice(self.rank * g, (self.rank + 1) * g)

    def to_heads(self, x: Tensor) -> Tensor:
        """``head`` mode's all-to-all: the local tokens of every head ``[B, 2n, H, ...]``
        -> every token of this rank's heads ``[B, T, H / N, ...]``."""
        heads = x.shape[2]
        if heads % self.size:
            raise ValueError(
                f"head-parallel attention needs heads divisible by the {self.size} ranks, got {heads}"
            )
        return self._in_order(self._all_to_all(list(x.chunk(self.size, dim=2))))

    def from_heads(self, o: Tensor) -> Tensor:
        """The inverse of :meth:`to_heads`: ``[B, T, H / N, ...]`` -> ``[B, 2n, H, ...]``."""
        size = self.size
        n = o.shape[1] // (2 * size)
        parts = [torch.cat([o.narrow(1, s * n, n), o.narrow(1, (2 * size - 1 - s) * n, n)], dim=1)
                 for s in range(size)]
        return torch.cat(self._all_to_all(parts), dim=2)

    def gather_ranges(
        self, starts: Tensor, *xs: Tensor
    ) -> tuple[list[int], list[tuple[int, int]], list[Tensor]]:
        """The keys each of this rank's chunks needs, from ``starts[i]`` (a global position;
        ``starts`` an integer tensor ``[2]`` on the device) to the chunk's end, and nothing
        before. Every rank sends each other rank only the tokens it asked for (a variable
        all-to-all); the gradients go back the same way. Every rank of the group must call
        it. The ranks' starts are gathered on the device and read on the host once (the
        all-to-all's sizes).

        Returns ``(starts, intervals, gathered)``: this rank's starts as ints, the merged
        global intervals it receives, in order, and each local ``x`` ``[B, 2n, ...]`` as
        those intervals' tokens ``[B, sum of lengths, ...]``."""
        n = self._chunk_length(xs[0].shape[1])
        size = self.size
        every = _all_gather_autograd(starts.detach().reshape(2).long(), 0, self._group)  # [N * 2]
        table = every.view(size, 2).tolist()  # the one host read

        def wanted(rank: int) -> list[tuple[int, int]]:  # the merged intervals rank receives
            spans = []
            for s, c in zip(table[rank], (rank, 2 * size - 1 - rank), strict=True):
                if not 0 <= s <= c * n:
                    raise ValueError(f"a chunk starting at {c * n} cannot need keys from {s}")
                spans.append((s, (c + 1) * n))
            if spans[1][0] <= spans[0][1]:  # overlapping or touching: one interval
                spans = [(spans[0][0], spans[1][1])]
            return spans

        def owned(rank: int) -> list[tuple[int, int, int]]:  # (global start, global end, local start)
            a, b = rank, 2 * size - 1 - rank
            return [(a * n, (a + 1) * n, 0), (b * n, (b + 1) * n, n)]

        def pieces(asked, rank):  # the parts of rank's tokens in the intervals asked, in order
            out = []
            for lo, hi in asked:
                for g0, g1, l0 in owned(rank):
                    a, b = max(lo, g0), min(hi, g1)
                    if a < b:
                        out.append((a, b, l0 + a - g0))
            return out

        asks = [wanted(rank) for rank in range(size)]
        send = [pieces(asks[dst], self.rank) for dst in range(size)]
        recv = [pieces(asks[self.rank], src) for src in range(size)]
        send_sizes = [sum(b - a for a, b, _ in ps) for ps in send]
        recv_sizes = [sum(b - a for a, b, _ in ps) for ps in recv]
        # what arrives, (global start, end, where in the received buffer), in global order
        from_rank = _starts(recv_sizes)
        arrived = sorted((a, b, from_rank[src] + off) for src, ps in enumerate(recv)
                         for off, (a, b, _) in zip(_starts([b - a for a, b, _ in ps]), ps, strict=True))
        out = []
        for x in xs:
            t_major = x.transpose(0, 1)  # [2n, B, ...]: the all-to-all splits dim 0
            parts = [t_major[l0 : l0 + b - a] for ps in send for a, b, l0 in ps]
            flat = torch.cat(parts) if parts else t_major[:0]
            got = funcol.all_to_all_single_autograd(flat.contiguous(), recv_sizes, send_sizes, self._group)
            ordered = [got[at : at + b - a] for a, b, at in arrived]
            out.append(torch.cat(ordered).transpose(0, 1))  # [B, tokens, ...]
        return table[self.rank], asks[self.rank], out

    @property
    def _group(self):
        return dist.group.WORLD if self.group is None else self.group

    # -- attention ---------------------------------------------------------------------------

    def attend(self, fn: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor, *per_key: Tensor,
               shared: tuple[Tensor, ...] = ()) -> Tensor:
        """``fn(q, k, v, *per_key, *shared)``, a kind's causal attention with queries at
        the end of the keys, over the whole sequence, for the local queries.

        ``q`` ``[B, 2n, H, D]``, ``k, v`` ``[B, 2n, K, D]``, ``per_key`` tensors
        ``[B, 2n, heads, ...]`` (in ``head`` mode split by heads like ``q`` or ``k``, in
        ``gather`` mode gathered like ``k``); ``shared``: tensors of the whole sequence
        that every head reads, passed as they are (``head`` mode only; e.g. DCP's
        ``[B, T, T]`` mask). Returns ``[B, 2n, H, D]``."""
        if self.mode == "head":
            heads = [self.to_heads(t) for t in (q, k, v, *per_key)]
            return self.from_heads(fn(*heads, *shared))
        if shared:
            raise ValueError("gather-mode context parallelism takes no shared inputs: use mode 'head'")
        keys = [self.gather(t) for t in (k, v, *per_key)]  # [B, T, ...] each
        n = self._chunk_length(q.shape[1])
        a, b = self.chunks  # each chunk's queries see the keys before its end
        # Two calls written out rather than a loop: under torch.compile a graph break inside
        # a loop (an eager op) makes Dynamo skip the whole frame, outside one it only splits it.
        o_a = fn(q[:, :n], *(t[:, : (a + 1) * n] for t in keys))  # [B, n, H, D]
        o_b = fn(q[:, n:], *(t[:, : (b + 1) * n] for t in keys))  # [B, n, H, D]
        return torch.cat([o_a, o_b], dim=1)  # [B, 2n, H, D]


def _starts(sizes: list[int]) -> list[int]:
    """Where each of parts of these sizes starts in their concatenation."""
    return [0, *itertools.accumulate(sizes)][:-1]


__all__ = ["CP_MODES", "ContextParallel"]
