"""The attention benchmark's workload, so numbers compare across runs and machines.

bf16, ``HQ`` query heads over ``H`` key/value heads, head dim ``D``, ``B x T`` tokens
(32768 by default). ``q`` and ``k`` are RMS-normalised per head with unit gain (what a
QK-norm layer gives), so every query and key has norm ``sqrt(D)``; ``v ~ N(0, 1)``.
Gates: 70% of the query heads are *local*, 30% *global*:

- a local head ``h`` draws a decay rate ``a_h`` log-uniform in ``[0.05, 0.7]`` and
  per-token logits ``-log(expm1(a_h)) + 0.5 N(0, 1)``, so that without the noise
  ``-log f = softplus(-logit) = a_h``: the head forgets at rate ``a_h`` per token;
- a global head uses logits ``9 + 0.5 N(0, 1)`` (``-log f`` about ``1.2e-4``);

and ``log_fgate = logsigmoid(logits)`` in float32. Which heads are local is drawn once
per workload (a random subset of ``round(0.7 HQ)`` heads); rates belong to heads and are
shared by the batch, the noise is per token.

Everything is drawn from one ``torch.Generator`` seeded with ``seed`` on the target
device, directly in place (no host-to-device copies): the same seed gives the same
tensors on the same kind of device. CPU and CUDA generators differ, so a CPU workload
is not the GPU one, only its small-scale twin for tests.

Variants: head dim 128 with 12 heads, GQA (24 query heads over 6
key/value heads), and varlen: 8 packed sequences of mixed lengths summing to the token
count (:data:`VARLEN_FRACTIONS`), with int32 ``cu_seqlens``.

Shapes: ``q [B, T, HQ, D]``, ``k, v [B, T, H, D]``, ``log_fgate [B, T, HQ]`` float32;
varlen packs them as ``B = 1``, ``T = tokens``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lapse.ops.forgetting.common import qk_norm_bound

LOCAL_SHARE = 0.7
LOCAL_RATE_RANGE = (0.05, 0.7)
GLOBAL_LOGIT = 9.0
LOGIT_NOISE = 0.5

# Shares of the packed tokens taken by the 8 varlen sequences: mixed lengths (a quarter
# down to under 5%) that are not multiples of the kernels' tiles at 32768 tokens
# (8192, 6226, 5079, 4096, 3113, 2621, 1966, 1475).
VARLEN_FRACTIONS = (0.25, 0.19, 0.155, 0.125, 0.095, 0.08, 0.06, 0.045)


@dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    """Shape of one benchmark workload; the defaults are the 760M model's attention (24 heads
    of 64)."""

    seq_len: int = 4096
    """T, the length of each sequence (ignored with ``varlen``: then B = 1, T = tokens)."""
    tokens: int = 32768
    """B x T, the tokens per batch; B = tokens // seq_len."""
    heads: int = 24
    """HQ, query heads (the gates are per query head)."""
    kv_heads: int | None = None
    """H, key/value heads; ``None`` means HQ (no grouped-query attention)."""
    head_dim: int = 64
    """D."""
    varlen: bool = False
    """Pack ``len(VARLEN_FRACTIONS)`` sequences of mixed lengths summing to ``tokens``."""
    dtype: torch.dtype = torch.bfloat16
    """dtype of q, k, v (the gates are always float32)."""

    def __post_init__(self) -> None:
        h = self.heads if self.kv_heads is None else self.kv_heads
        if self.heads < 1 or h < 1 or self.heads % h != 0:
            raise ValueError(
                f"heads ({self.heads}) must be a positive multiple of kv_heads ({self.kv_heads})"
            )
        if not 1 <= self.head_dim <= 256:
            raise ValueError(f"head_dim must be in [1, 256], got {self.head_dim}")
        if self.varlen:
            if self.tokens < len(VARLEN_FRACTIONS):
                raise ValueError(
                    f"varlen needs tokens >= {len(VARLEN_FRACTIONS)}, got {self.tokens}"
                )
        elif self.seq_len < 1 or self.tokens % self.seq_len != 0:
            raise ValueError(
                f"tokens ({self.tokens}) must be a positive multiple of seq_len ({self.seq_len})"
            )

    @property
    def num_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def batch(self) -> int:
        return 1 if self.varlen else self.tokens // self.seq_len

    @property
    def time(self) -> int:
        """Length of the time axis of the tensors (the packed length with varlen)."""
        return self.tokens if self.varlen else self.seq_len

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def qk_norm_bound(self) -> float:
        """ACP bound ``U`` known from QK-norm: ``|q| = |k| = sqrt(D)``, so
        ``|scale q.k| <= D * scale = sqrt(D)``, times the factor for the rounding of the
        16-bit ``q`` and ``k`` (what a QK-norm layer's ``logit_bound`` gives)."""
        return qk_norm_bound(1.0, 1.0, self.head_dim, self.scale)

    @property
    def seqlens(self) -> list[int]:
        """Lengths of the sequences: ``B`` times ``T``, or the varlen mix."""
        if not self.varlen:
            return [self.seq_len] * self.batch
        return varlen_lengths(self.tokens)

    @property
    def label(self) -> str:
        """Short readable id, e.g. ``HQ24-H6-D64-T4096`` or ``HQ24-H24-D64-varlen``."""
        t = "varlen" if self.varlen else f"T{self.seq_len}"
        return f"HQ{self.heads}-H{self.num_kv_heads}-D{self.head_dim}-{t}"


@dataclass(frozen=True)
class Workload:
    """Tensors of one workload (see the module docstring for the distributions)."""

    spec: WorkloadSpec
    q: Tensor  # [B, T, HQ, D]
    k: Tensor  # [B, T, H, D]
    v: Tensor  # [B, T, H, D]
    log_fgate: Tensor  # [B, T, HQ] float32
    local_rate: Tensor  # [HQ] float32: a_h of local heads, NaN for global heads
    cu_seqlens: Tensor | None  # [num_seqs + 1] int32 with varlen, else None

    @property
    def is_local(self) -> Tensor:
        """[HQ] bool: which query heads are local."""
        return ~torch.isnan(self.local_rate)


def varlen_lengths(tokens: int) -> list[int]:
    """Mixed sequence lengths summing to ``tokens`` (the last one takes the rounding)."""
    lengths = [max(1, round(tokens * f)) for f in VARLEN_FRACTIONS[:-1]]
    last = tokens - sum(lengths)
    if last < 1:
        raise ValueError(f"tokens={tokens} is too small to split into {len(VARLEN_FRACTIONS)}")
    return lengths + [last]


def rms_normalise(x: Tensor, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the head dim with unit gain: every vector gets norm ``sqrt(D)``."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def gate_logits(
    batch: int, time: int, heads: int, *, generator: torch.Generator, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Forget-gate logits ``[B, T, HQ]`` float32 and the local rates ``[HQ]`` (NaN: global)."""
    n_local = round(LOCAL_SHARE * heads)
    order = torch.randperm(heads, generator=generator, device=device)
    is_local = torch.zeros(heads, dtype=torch.bool, device=device)
    is_local[order[:n_local]] = True
    lo, hi = LOCAL_RATE_RANGE
    u = torch.rand(heads, generator=generator, device=device, dtype=torch.float64)
    rate = torch.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))  # [HQ], log-uniform
    # softplus(-logit) = a  <=>  logit = -log(expm1(a)): f = sigmoid(logit) = exp(-a)
    local_logit = -torch.log(torch.expm1(rate))  # [HQ]
    center = torch.where(is_local, local_logit, torch.full_like(local_logit, GLOBAL_LOGIT))
    noise = torch.randn(batch, time, heads, generator=generator, device=device)
    logits = center.float() + LOGIT_NOISE * noise  # [B, T, HQ]
    local_rate = torch.where(is_local, rate, torch.full_like(rate, math.nan)).float()
    return logits, local_rate


def make_workload(
    spec: WorkloadSpec, *, device: str | torch.device = "cuda", seed: int = 0
) -> Workload:
    """Draws the tensors of ``spec`` on ``device``, deterministically from ``seed``."""
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    b, t, hq, h, d = spec.batch, spec.time, spec.heads, spec.num_kv_heads, spec.head_dim

    def normal(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    q = rms_normalise(normal(b, t, hq, d)).to(spec.dtype)
    k = rms_normalise(normal(b, t, h, d)).to(spec.dtype)
    v = normal(b, t, h, d).to(spec.dtype)
    logits, local_rate = gate_logits(b, t, hq, generator=gen, device=device)
    log_fgate = torch.nn.functional.logsigmoid(logits)  # [B, T, HQ] float32
    cu_seqlens = None
    if spec.varlen:
        offsets = [0]
        for n in spec.seqlens:
            offsets.append(offsets[-1] + n)
        cu_seqlens = torch.tensor(offsets, dtype=torch.int32, device=device)
    return Workload(spec, q, k, v, log_fgate, local_rate, cu_seqlens)


def dense_causal_flops(spec: WorkloadSpec) -> float:
    """Forward FLOPs of dense causal attention: ``sum_seq 4 L^2 HQ D / 2``.

    Two matmuls (``Q K^T`` and ``P V``) of ``2 L^2 D`` FLOPs each per head, halved for
    causality. Pruned tiles are still counted (FLOPs of the dense problem), so a pruning
    kernel shows its saving as a higher TFLOP/s. The backward counts 2.5x the forward.
    """
    return sum(4.0 * n * n * spec.heads * spec.head_dim / 2 for n in spec.seqlens)
